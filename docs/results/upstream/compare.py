"""Our DFlash 2 loop against upstream's MLX loop (`dflash==0.1.0`), same drafter, same width.

Upstream is not a dependency and none of its code is here: download its wheel, unpack it, and
pass the folder (`pip download --no-deps dflash==0.1.0 -d /tmp/up && unzip -q -o
/tmp/up/dflash-0.1.0-py3-none-any.whl -d /tmp/up/src`). Preload the fast BLAS that `dflash2
doctor` names, as the `dflash2` command does for itself:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python docs/results/upstream/compare.py /tmp/up/src --width 4

Both loops decode the same held-out chat prompts greedily, interleaved prompt by prompt after a
warm-up, on separate copies of the target (fp32), with the drafter in fp32 for both. Every output
is compared token for token with our plain decoding. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _upstream(src: str, target_path: str, drafter_path: str):
    sys.path.insert(0, src)
    import mlx.core as mx
    from dflash import model_mlx as up
    from mlx_lm import load

    from dflash2_mlx.target import _cast

    up.snapshot_download = lambda repo, **kw: repo  # local folders, no hub
    model, tokenizer = load(target_path)
    _cast(model, mx.float32)
    draft = up.load_draft(drafter_path)
    draft.set_dtype(mx.float32)
    return up, model, tokenizer, draft


def _run_upstream(up, model, tokenizer, draft, ids, width, max_tokens, eos):
    tokens, t_first = [], None
    t0 = time.perf_counter()
    for r in up.stream_generate(model, draft, tokenizer, ids, block_size=width, max_tokens=max_tokens):
        t_first = t_first or time.perf_counter()
        tokens.extend(t for t in r.tokens if t not in eos)
    return tokens, time.perf_counter() - t_first


def _run_ours(session, drafter, ids, width, max_tokens):
    from dflash2_mlx import stream_generate

    tokens, cycles, t_first = [], [], None
    for ev in stream_generate(session.target, ids, drafter=drafter, max_tokens=max_tokens, block_size=width):
        t_first = t_first or time.perf_counter()
        tokens.extend(ev.tokens)
        if ev.cycle is not None and ev.cycle.n_drafted:
            cycles.append(ev.cycle.n_accepted + 1)
    return tokens, time.perf_counter() - t_first, cycles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("upstream", help="folder holding the unpacked dflash==0.1.0 wheel")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--n", type=int, default=3, help="prompts per suite")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="our compact proposal head's size (0 = the full head, as upstream drafts)")
    ap.add_argument("--json", default="docs/results/upstream/compare.json")
    args = ap.parse_args()

    from dflash2_mlx import blas
    from dflash2_mlx.prompts import load_suites, parse_suites
    from dflash2_mlx.session import Session

    session = Session.open(None, progress=False, draft_vocab=args.draft_vocab)
    up, model, tokenizer, draft = _upstream(args.upstream, str(session.spec.target), str(session.spec.drafter))
    suites = load_suites(parse_suites("gsm8k,humaneval,mtbench"), args.n)
    prompts = [p for s in suites for p in s.prompts]
    eos = set(session.target.eos_token_ids)
    rows = []
    warm = session.encode(prompts[0].text)
    _run_ours(session, session.drafter, warm, args.width, 16)
    _run_upstream(up, model, tokenizer, draft, warm, args.width, 16, eos)
    from dflash2_mlx import generate

    for j, p in enumerate(prompts):
        ids = session.encode(p.text)
        plain = generate(session.target, ids, max_tokens=args.max_tokens).tokens
        order = ("ours", "upstream") if j % 2 == 0 else ("upstream", "ours")
        row = {"suite": p.suite, "id": p.id}
        for who in order:
            if who == "ours":
                tokens, seconds, taus = _run_ours(session, session.drafter, ids, args.width, args.max_tokens)
                row["ours_tau"] = sum(taus) / len(taus) if taus else None
            else:
                tokens, seconds = _run_upstream(up, model, tokenizer, draft, ids, args.width, args.max_tokens, eos)
            row[f"{who}_tokens"], row[f"{who}_s"] = len(tokens), seconds
            row[f"{who}_equals_plain"] = tokens == plain
        rows.append(row)
        print(f"{p.suite}/{p.id}: ours {(row['ours_tokens'] - 1) / row['ours_s']:.1f} tok/s, upstream "
              f"{(row['upstream_tokens'] - 1) / row['upstream_s']:.1f} tok/s, identical "
              f"{row['ours_equals_plain']}/{row['upstream_equals_plain']}", file=sys.stderr)
    ours = sum(r["ours_tokens"] - 1 for r in rows) / sum(r["ours_s"] for r in rows)
    upstream = sum(r["upstream_tokens"] - 1 for r in rows) / sum(r["upstream_s"] for r in rows)
    summary = {"width": args.width, "draft_vocab": args.draft_vocab, "n_prompts": len(rows), "max_tokens": args.max_tokens,
               "ours_tps": ours, "upstream_tps": upstream, "ours_over_upstream": ours / upstream,
               "all_ours_equal_plain": all(r["ours_equals_plain"] for r in rows),
               "all_upstream_equal_plain": all(r["upstream_equals_plain"] for r in rows),
               "tau_ours": statistics.mean(r["ours_tau"] for r in rows if r["ours_tau"]),
               "blas": blas.active_blas()["name"]}
    print(f"| loop | block | decode tok/s | ours / upstream | all equal plain |\n|---|---|---|---|---|\n"
          f"| ours | {args.width} | {ours:.1f} | {ours / upstream:.2f} | {summary['all_ours_equal_plain']} |\n"
          f"| upstream dflash 0.1.0 | {args.width} | {upstream:.1f} | 1.00 | {summary['all_upstream_equal_plain']} |")
    Path(args.json).write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
