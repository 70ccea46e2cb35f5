"""A running stream's largest gap between tokens while a 2,000-token prompt joins (issue 23).

In one process, the server's worker over the demo pair (its defaults: `--max-batch 32`,
`--prefill-chunk 512`, the session's width): stream A (a held-out prompt, `--max-tokens`) runs;
after its fifth event, B arrives with a ~2,000-token prompt (package sources + a question, as
`dflash2 bench --context`). A's gaps between events while B's prompt is prefilled are compared
with one prefill chunk's time on this machine (the target's forward over 512 tokens at that
context, measured after). The goal: the worst gap <= 2 x one chunk.

    .venv/bin/python docs/results/batching/token_gap.py --json docs/results/batching/token_gap.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dflash2_mlx.blas import find_fast_blas, reexec_env, should_reexec

if should_reexec()[0] and (found := find_fast_blas()) is not None:
    os.execve(sys.executable, [sys.executable, *sys.argv], reexec_env(found))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_batch import held_out  # noqa: E402


def chunk_seconds(session, ids: list[int], chunk: int) -> float:
    """Median time of the target's forward over `chunk` tokens after the first `chunk`."""
    import mlx.core as mx

    times = []
    for _ in range(3):
        cache = session.target.make_cache()
        logits, _ = session.target.forward(mx.array([ids[:chunk]]), cache, (), "last")
        mx.eval(logits)
        t0 = time.perf_counter()
        logits, _ = session.target.forward(mx.array([ids[chunk : 2 * chunk]]), cache, (), "last")
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def run(session, a_ids, b_ids, max_tokens, chunk):
    from dflash2_mlx.core.sampling import SamplingParams
    from dflash2_mlx.server.config import DEFAULT_MAX_BATCH
    from dflash2_mlx.server.worker import GenerationWorker, Job

    loop = asyncio.get_running_loop()
    worker = GenerationWorker(session, capacity=8, prefill_chunk=chunk, max_batch=DEFAULT_MAX_BATCH)
    worker.start()
    a = Job(a_ids, SamplingParams(), max_tokens, [], loop)
    worker.submit(a)
    stamps, b_sent, b_first = [], None, None
    b = Job(b_ids, SamplingParams(), 8, [], loop)

    async def follow_b():
        nonlocal b_first
        async for _ in b.events():
            b_first = b_first or time.perf_counter()

    waiter = None
    async for _ in a.events():
        stamps.append(time.perf_counter())
        if len(stamps) == 5:
            b_sent = time.perf_counter()
            worker.submit(b)
            waiter = asyncio.ensure_future(follow_b())
    if waiter is None:  # A ended within five events (the warm-up's short reply): B runs after it
        b_sent = time.perf_counter()
        worker.submit(b)
        waiter = asyncio.ensure_future(follow_b())
    await waiter
    worker.close()
    return stamps, b_sent, b_first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dflash2_mlx.bench import default_encoder
    from dflash2_mlx.long_context import context_suite
    from dflash2_mlx.session import Session

    session = Session.open(None, progress=False)
    a_ids = held_out(1, session.encode)[0]
    encode = default_encoder(session.target)
    b_ids = encode(context_suite(session.target.tokenizer, encode, args.context, 1).prompts[0])
    asyncio.run(run(session, held_out(2, session.encode)[1], a_ids, 24, args.chunk))  # warm-up
    stamps, b_sent, b_first = asyncio.run(run(session, a_ids, b_ids, args.max_tokens, args.chunk))
    gaps = [(t1 - t0, t0) for t0, t1 in zip(stamps, stamps[1:])]
    during = [g for g, t0 in gaps if t0 >= b_sent - 1e-3 and t0 < b_first] or [0.0]
    outside = [g for g, t0 in gaps if t0 < b_sent or t0 >= b_first]
    chunk_s = chunk_seconds(session, b_ids, args.chunk)
    out = {"prompt_tokens": len(b_ids), "chunk": args.chunk, "chunk_s": chunk_s,
           "worst_gap_during_s": max(during), "median_gap_during_s": statistics.median(during),
           "median_gap_outside_s": statistics.median(outside), "n_gaps_during": len(during),
           "worst_over_chunk": max(during) / chunk_s, "b_ttft_s": b_first - b_sent}
    for k, v in out.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
