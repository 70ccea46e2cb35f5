"""One request alone: the single-stream engine against the batch engine holding one row.

Decides whether every batchable request could start in the batch (no solo engine, no
handover): the batch of one must decode as fast as the solo engine. Demo pair, held-out
prompts one at a time (the bundled suites in turn, chat template, greedy), modes interleaved
per prompt after a warm-up: `mlx_lm.stream_generate` (the reference), ours solo plain, the
batch's one row plain, ours solo DFlash 2 at `--width`, the batch's row at `--width`. Decode
tok/s = tokens after the first / time from the first token to the end. Every row must equal
`mlx_lm.stream_generate`'s tokens.

    .venv/bin/python docs/results/batching/solo_vs_row.py --json docs/results/batching/solo_vs_row.json

Run on a quiet machine (the script re-executes itself with the fast BLAS preloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dflash2_mlx.blas import find_fast_blas, reexec_env, should_reexec

if should_reexec()[0] and (found := find_fast_blas()) is not None:
    os.execve(sys.executable, [sys.executable, *sys.argv], reexec_env(found))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_batch import held_out, mlx_single  # noqa: E402


def solo(session, ids, n, width):
    from dflash2_mlx.core.generate import stream_generate

    tokens, t_first = [], None
    for ev in stream_generate(session.target, ids, drafter=session.drafter if width > 1 else None, max_tokens=n,
                              block_size=width if width > 1 else None):
        t_first = t_first or time.perf_counter()
        tokens.extend(ev.tokens)
    return tokens, time.perf_counter() - t_first


def row(session, ids, n, width):
    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    batch = SpeculativeBatch(session.target, session.drafter if width > 1 else None,
                             block_size=width if width > 1 else None, prefill_step_size=4096)
    batch.add(ids, n)
    tokens, t_first = [], None
    while len(batch):
        for _, ev in batch.step():
            t_first = t_first or time.perf_counter()
            tokens.extend(ev.tokens)
    return tokens, time.perf_counter() - t_first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dflash2_mlx.session import Session

    session = Session.open(None, progress=False)
    prompts = held_out(args.n + 1, session.encode)
    w, n = args.width, args.max_tokens
    modes = {"mlx_lm.stream_generate": lambda ids: mlx_single(session, [ids], n),
             "solo plain": lambda ids: solo(session, ids, n, 1), "row plain": lambda ids: row(session, ids, n, 1),
             f"solo @{w}": lambda ids: solo(session, ids, n, w), f"row @{w}": lambda ids: row(session, ids, n, w)}
    for run in modes.values():
        run(prompts[0])  # warm-up
    totals = {name: [0, 0.0] for name in modes}
    equal = {name: True for name in modes}
    for ids in prompts[1:]:
        ref = None
        for name, run in modes.items():
            out = run(ids)
            tokens, seconds = (out[0][0], out[1]) if name == "mlx_lm.stream_generate" else out
            tokens = [t for t in tokens if t not in session.target.eos_token_ids]
            ref = tokens if ref is None else ref
            equal[name] &= tokens == ref
            totals[name][0] += max(len(tokens) - 1, 0)
            totals[name][1] += seconds
    base = totals["mlx_lm.stream_generate"][0] / totals["mlx_lm.stream_generate"][1]
    rows = {name: {"decode_tps": t / s, "x_mlx_lm": t / s / base, "tokens": t, "seconds": s, "equal": equal[name]}
            for name, (t, s) in totals.items()}
    print(f"{'mode':24s} {'decode tok/s':>12s} {'x mlx_lm':>9s}  equal")
    for name, r in rows.items():
        print(f"{name:24s} {r['decode_tps']:12.2f} {r['x_mlx_lm']:9.3f}  {r['equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "modes": rows}, indent=1))


if __name__ == "__main__":
    main()
