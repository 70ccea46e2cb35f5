"""Decode tok/s and per-cycle draft/verify time of the demo pair, full head vs compact head, interleaved.

Separate `dflash2 bench` runs drift with the shared machine's load; here one process alternates
the head (and plain decoding) prompt by prompt, so load changes hit every variant alike.
Writes interleaved.json next to this file.

    .venv/bin/python docs/results/compact-head/measure_interleaved.py [--rounds 2 --max-tokens 96]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from dflash2_mlx import blas
from dflash2_mlx.drafter.vocab import find_vocab_file, read_vocab_file
from dflash2_mlx.prompts import load_suites, parse_suites
from dflash2_mlx.session import Session

VARIANTS = ("ar", "full", "8192")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--n", type=int, default=2, help="prompts per suite")
    args = ap.parse_args()
    reexec, _ = blas.should_reexec()
    if reexec:  # the same fast BLAS the dflash2 command preloads
        os.execve(sys.executable, [sys.executable, *sys.argv], blas.reexec_env(blas.find_fast_blas()))
    session = Session.open(progress=False, block_size=4)
    drafter = session.drafter
    vocab = read_vocab_file(find_vocab_file(drafter.path))
    prompts = [p for s in load_suites(parse_suites("gsm8k,humaneval,mtbench"), args.n) for p in s.prompts]
    stats = {v: {"tps": [], "draft_ms": [], "verify_ms": [], "tau": []} for v in VARIANTS}
    session.generate(prompts[0].text, max_tokens=16)  # warm-up
    for _ in range(args.rounds):
        for p in prompts:
            ref = None
            for v in VARIANTS:
                drafter.use_proposal_vocab(None if v in ("ar", "full") else vocab.resized(int(v)))
                session.drafter = None if v == "ar" else drafter
                r = session.generate(p.text, max_tokens=args.max_tokens)
                ref = ref or r.tokens
                assert r.tokens == ref, f"{v} differs from plain decoding"
                s = stats[v]
                s["tps"].append(r.generation_tps)
                spec = r.speculative_cycles
                if spec:
                    s["draft_ms"].append(1e3 * statistics.mean(c.draft_s for c in spec))
                    s["verify_ms"].append(1e3 * statistics.mean(c.verify_s for c in spec))
                    s["tau"].append(r.tau)
    out = {v: {k: round(statistics.median(x), 3) if x else None for k, x in s.items()} for v, s in stats.items()}
    for v, s in out.items():
        print(v, s)
    meta = {"blas": blas.describe()["active"], "rounds": args.rounds, "max_tokens": args.max_tokens,
            "n_prompts": len(prompts), "block_size": 4, "statistic": "median over prompt runs"}
    Path(__file__).with_name("interleaved.json").write_text(
        json.dumps({"meta": meta, "variants": out, "raw": stats}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
