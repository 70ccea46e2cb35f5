"""One rank of a sharded tiny target, run by test_distributed.py under `mlx.launch -n 2 --backend
ring`: decodes plainly and speculatively (drafter on rank 0 only) and writes what it emitted.
Arguments: family, output folder, and the sharding (tensor, the default, or pipeline)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from test_engine_hooks import ScriptedWidths  # noqa: E402

from dflash2_mlx import SamplingParams, generate  # noqa: E402
from dflash2_mlx.core.distributed import agree_taps, launched, split_model  # noqa: E402
from dflash2_mlx.target import Target  # noqa: E402

from test_engine import ScriptedDrafter  # noqa: E402
from tiny import FAMILIES, TinyTokenizer, tiny_drafter, tiny_model  # noqa: E402

PROMPT = [1, 5, 9, 14, 3, 22, 7, 31, 40, 12, 18, 6, 27, 33, 8, 11]
N = 24


def main(family: str, out: Path, mode: str = "tensor", calibration_dir: str | None = None) -> None:
    lockstep = launched(mode)
    assert lockstep is not None and lockstep.size == 2, "launch with mlx.launch -n 2"
    # qwen3_5's shard splits an untied head by vocabulary, which the tiny vocab (97) cannot divide
    kwargs = {"text_config": dict(FAMILIES[family]["text_config"], tie_word_embeddings=True)} \
        if family == "qwen3_5" else {}
    alone = Target(tiny_model(family, **kwargs), TinyTokenizer.make())
    single = generate(alone, PROMPT, max_tokens=N).tokens
    model = tiny_model(family, **kwargs)
    split_model(model, lockstep)
    target = Target(model, TinyTokenizer.make(), path=f"tiny-{family}")
    lead = lockstep.leader
    drafter = tiny_drafter(target, "dflash2", block_size=4) if lead else None
    agree_taps(lockstep, target, (0, 1, 2, 3))  # the tiny drafter's taps 0, 2, 3 and the scripted one's 1
    run = dict(max_tokens=N, lockstep=lockstep)
    # the taps a pass gives rank 0 (gathered from both stages when pipelined) against the unsharded target's
    ids = mx.array([PROMPT])
    logits, theirs = target.forward(ids, target.make_cache(), (0, 2, 3) if lead else (), "last")
    mx.eval(logits)  # on every rank: the pass's collectives
    ours = alone.forward(ids, alone.make_cache(), (0, 2, 3), "last")[1]
    taps_error = float(mx.abs(theirs - ours).max().item()) if lead else 0.0
    plain = generate(target, PROMPT, **run)
    spec = generate(target, PROMPT, drafter=drafter, block_size=4, **run)
    scripted = ScriptedDrafter(target, PROMPT + plain.tokens + [3] * 32, 4) if lead else None
    partial = generate(target, PROMPT, drafter=scripted, block_size=4, **run)
    seeded = [generate(target, PROMPT, drafter=drafter, block_size=4, sampling=SamplingParams(temperature=0.8, seed=5),
                       **run).tokens for _ in range(2)]
    seeded_plain = generate(target, PROMPT, sampling=SamplingParams(temperature=0.8, seed=5), **run).tokens
    # rank 0's policy picks each cycle's width (plain steps between speculative ones); the others follow
    widths = ScriptedWidths([1, 3, 4, 2, 1, 1, 4]) if lead else None
    varied = generate(target, PROMPT, drafter=scripted, block_size=4, block_policy=widths, **run)
    calibrated = None
    if calibration_dir:  # `--block-size auto`'s calibration, every rank in each timed pass
        from dflash2_mlx.core.block_policy import AdaptiveBlockPolicy
        from dflash2_mlx.core.calibration import agree_calibration

        cal = agree_calibration(lockstep, target, drafter, cache_dir=Path(calibration_dir))
        policy = AdaptiveBlockPolicy(cal.costs) if lead else None
        auto = generate(target, PROMPT, drafter=drafter, block_size=4, block_policy=policy, **run)
        again = agree_calibration(lockstep, target, drafter, cache_dir=Path(calibration_dir))  # cached: no passes
        calibrated = {"max_width": cal.costs.max_width if lead else None, "auto": auto.tokens,
                      "cached": again is not None and again.key == cal.key if lead else None}
    (out / f"rank{lockstep.rank}.json").write_text(json.dumps({
        "rank": lockstep.rank, "info": lockstep.describe(), "single": single, "taps_error": taps_error,
        "plain": plain.tokens, "spec": spec.tokens,
        "spec_accepted": [c.n_accepted for c in spec.speculative_cycles], "partial": partial.tokens,
        "partial_accepted": [c.n_accepted for c in partial.speculative_cycles], "seeded": seeded,
        "seeded_plain": seeded_plain, "varied": varied.tokens, "varied_widths": [c.width for c in varied.cycles],
        "calibrated": calibrated}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
