"""Drafter pass time of the demo pair with and without the compact proposal head.

Median of repeated `drafter.draft_from` calls (mx.eval on the drafts) after a 128-token context,
at blocks 4 and 8, for each proposal vocab size; sizes alternate within every round so machine
noise hits all of them alike. Prints a table and writes propose.json next to this file.

    .venv/bin/python docs/results/compact-head/measure_propose.py [--rounds 5 --reps 15]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash2_mlx import blas
from dflash2_mlx.drafter.vocab import find_vocab_file, read_vocab_file
from dflash2_mlx.session import Session

SIZES = (0, 16384, 8192, 4096)  # 0 = the full 49,152-row head


def propose_ms(drafter, hidden, block: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        cache = drafter.make_cache()  # 127 context rows, then the timed pass adds the 128th
        mx.eval(drafter.hidden_states(mx.array([[5] + [16] * (block - 1)]), hidden[:, :-1], cache))
        t = time.perf_counter()
        mx.eval(drafter.draft_from(mx.array([7]), hidden[:, -1:], cache, block).tokens)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    reexec, _ = blas.should_reexec()
    if reexec:  # the same fast BLAS the dflash2 command preloads
        os.execve(sys.executable, [sys.executable, *sys.argv], blas.reexec_env(blas.find_fast_blas()))
    session = Session.open(progress=False)
    target, drafter = session.target, session.drafter
    vocab = read_vocab_file(find_vocab_file(drafter.path))
    ids = [(i * 7919) % 40000 + 100 for i in range(128)]
    _, hidden = target.forward(mx.array([ids]), target.make_cache(), tuple(drafter.config.target_layer_ids), "none")
    mx.eval(hidden)
    rounds = {(s, b): [] for s in SIZES for b in (4, 8)}
    for _ in range(args.rounds):
        for size in SIZES:
            drafter.use_proposal_vocab(vocab.resized(size) if size else None)
            for block in (4, 8):
                propose_ms(drafter, hidden, block, 2)  # warm-up
                rounds[size, block].append(statistics.median(propose_ms(drafter, hidden, block, args.reps)))
    rows = []
    for (size, block), meds in rounds.items():
        rows.append({"draft_vocab": size or target.info.vocab_size, "compact": bool(size), "block": block,
                     "median_ms": round(statistics.median(meds), 2), "round_medians_ms": [round(m, 2) for m in meds],
                     "spread_ms": round(max(meds) - min(meds), 2),
                     "coverage_heldout": vocab.coverage.get(str(size)) if size else 1.0})
    print(f"{'vocab':>7} {'block':>5} {'median ms':>10} {'rounds (ms)':<40}")
    for r in sorted(rows, key=lambda r: (r["block"], -r["draft_vocab"])):
        print(f"{r['draft_vocab']:>7} {r['block']:>5} {r['median_ms']:>10.2f} {r['round_medians_ms']}")
    meta = {"blas": blas.describe()["active"], "rounds": args.rounds, "reps": args.reps, "context": 128,
            "target": str(session.spec.target), "drafter": drafter.path}
    out = Path(__file__).with_name("propose.json")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
