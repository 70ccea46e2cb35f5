"""Speculation inside the batch: aggregate decode tok/s against batch size, in one process.

On the demo pair (the registry's session: fp32 SmolLM2-135M + its DFlash 2 drafter), for each
batch size B the same B held-out prompts (the bundled suites in turn, chat template, greedy)
decode `--max-tokens` each in every mode, modes interleaved per level after a warm-up:

* `mlx-lm BatchGenerator`: mlx-lm's own batched plain decoding (what `mlx_lm.server` runs);
* `mlx_lm.stream_generate` x B: the reference single stream, the rows one after another;
* `ours plain`: `SpeculativeBatch` at width 1 (plain batched decoding on the ragged caches);
* `ours DFlash 2 @W`: every cycle at width W (`--width`);
* `ours auto`: the width chosen per cycle by `BatchWidthPolicy` from this machine's calibration.

With `--kv-bits 8` every mode stores quantized K/V from the first token (mlx-lm's
`QuantizedKVCache` for the reference, quantized rows for ours) and `mlx-lm BatchGenerator`,
whose batched caches stay in full precision, is left out: the reference is then
`mlx_lm.stream_generate` x B.

Aggregate decode tok/s = tokens after each row's first / the time from the last row's first
token to the end (prefill excluded: every mode prefills the same prompts); "with prefill" =
all tokens / the whole time from the rows' arrival (all at once) to the end. Every row of every
mode must equal `mlx_lm.stream_generate`'s tokens. Prints a table, writes JSON.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      .venv/bin/python docs/results/batching/spec_batch.py --json docs/results/batching/spec_batch.json

Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LEVELS = (1, 2, 4, 8)


def held_out(n: int, encode) -> list[list[int]]:
    from dflash2_mlx.prompts import load_suite

    suites = [load_suite(s, 12, bundled_only=True).prompts for s in ("mtbench", "gsm8k", "humaneval", "math500", "mbpp")]
    texts = [p.text for group in zip(*suites) for p in group]
    return [encode(t) for t in texts[:n]]


def mlx_single(session, prompts, n, kv=None):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from dflash2_mlx.bench import mlx_lm_cache

    rows, decode_s, t0 = [], 0.0, time.perf_counter()
    for ids in prompts:
        tokens, t_first = [], None
        for r in stream_generate(session.target.model, session.target.tokenizer, mx.array(ids), max_tokens=n,
                                 prompt_cache=mlx_lm_cache(session.target, kv or {})):
            if t_first is None:
                t_first = time.perf_counter()
            tokens.append(r.token)
        decode_s += time.perf_counter() - t_first
        rows.append([t for t in tokens if t not in session.target.eos_token_ids])
    return rows, decode_s, None, time.perf_counter() - t0


def mlx_batch(session, prompts, n):
    from mlx_lm.generate import BatchGenerator

    target = session.target
    gen = BatchGenerator(target.model, stop_tokens=[[t] for t in sorted(target.eos_token_ids)],
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    rows = {u: [] for u in uids}
    started = None
    while True:
        _, responses = gen.next()
        for r in responses:
            if r.token not in target.eos_token_ids:
                rows[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                rows[r.uid].append(None)
        if started is None and all(rows[u] for u in uids):
            started = time.perf_counter()
        if all(rows[u] and rows[u][-1] is None for u in uids):
            break
    end = time.perf_counter()
    return [[t for t in rows[u] if t is not None] for u in uids], end - started, None, end - t0


def ours(session, prompts, n, width=None, policy=None, kv=None):
    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    drafter = session.drafter if width != 1 else None
    batch = SpeculativeBatch(session.target, drafter, block_size=width if width and width > 1 else None,
                             policy=policy, prefill_step_size=4096, **(kv or {}))
    t0 = time.perf_counter()
    ids = {batch.add(p, n): i for i, p in enumerate(prompts)}
    rows = {i: [] for i in ids.values()}
    started, widths = None, []
    while len(batch):
        produced = batch.step()
        if started is None and not batch.joining:
            started = time.perf_counter()
        elif started is not None:
            widths.append(batch.last_width)
        for rid, ev in produced:
            rows[ids[rid]].extend(ev.tokens)
    end = time.perf_counter()
    return [rows[i] for i in range(len(prompts))], end - started, widths, end - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--kv-bits", type=int, default=None)
    ap.add_argument("--kv-group-size", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dflash2_mlx.core.block_policy import BatchWidthPolicy
    from dflash2_mlx.core.calibration import get_calibration
    from dflash2_mlx.session import Session

    session = Session.open(None, progress=False)
    levels = [int(x) for x in args.levels.split(",")]
    prompts = held_out(sum(levels) + 2, session.encode)
    costs = get_calibration(session.target, session.drafter, args.width).costs
    policy = BatchWidthPolicy(costs)  # one for the run: it learns across levels, as a server's would
    n = args.max_tokens
    kv = {}
    if args.kv_bits is not None:
        kv = {"kv_bits": args.kv_bits, "kv_group_size": session.target.kv_group_size(args.kv_bits, args.kv_group_size)}
    ours(session, prompts[:2], 8, kv=kv), mlx_single(session, prompts[:1], 8, kv)  # warm-up
    if not kv:
        mlx_batch(session, prompts[:2], 8)
    results, at = [], 2
    for B in levels:
        batch_prompts, at = prompts[at : at + B], at + B
        modes = {"mlx_lm.stream_generate x B": mlx_single(session, batch_prompts, n, kv)}
        ref = modes["mlx_lm.stream_generate x B"][0]
        if not kv:
            modes["mlx-lm BatchGenerator"] = mlx_batch(session, batch_prompts, n)
        modes["ours plain"] = ours(session, batch_prompts, n, width=1, kv=kv)
        modes[f"ours DFlash 2 @{args.width}"] = ours(session, batch_prompts, n, width=args.width, kv=kv)
        modes["ours auto"] = ours(session, batch_prompts, n, width=args.width, policy=policy, kv=kv)
        level = {"batch": B, "modes": {}}
        for name, (rows, seconds, widths, total_s) in modes.items():
            decoded = sum(max(len(r) - 1, 0) for r in rows)
            same = [r == e[: len(r)] and len(r) >= min(len(e), n) for r, e in zip(rows, ref)]
            level["modes"][name] = {"decode_tps": decoded / seconds, "tokens": decoded, "seconds": seconds,
                                    "total_tps": sum(map(len, rows)) / total_s, "total_s": total_s,
                                    "equal_to_mlx_lm": all(same),
                                    "mean_width": sum(widths) / len(widths) if widths else None}
            print(f"B={B:2d} {name:28s} decode {decoded / seconds:7.1f} tok/s  with prefill "
                  f"{sum(map(len, rows)) / total_s:6.1f} tok/s  equal={all(same)}"
                  + (f"  mean width {sum(widths) / len(widths):.2f}" if widths else ""), flush=True)
        results.append(level)
    report(results, args)


def report(results, args) -> None:
    names = list(results[0]["modes"])
    ref = "mlx-lm BatchGenerator" if "mlx-lm BatchGenerator" in names else "mlx_lm.stream_generate x B"
    for key, what in (("decode_tps", "decode"), ("total_tps", "with prefill")):
        print(f"\naggregate {what} tok/s (x {ref}), {args.max_tokens} tokens per row")
        print(f"{'B':>3} " + " ".join(f"{n:>28s}" for n in names))
        for level in results:
            base = level["modes"][ref][key]
            cells = [f"{m[key]:7.1f} ({m[key] / base:4.2f}x)" for m in level["modes"].values()]
            print(f"{level['batch']:>3} " + " ".join(f"{c:>28s}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "width": args.width,
                                               "kv_bits": args.kv_bits, "levels": results}, indent=1))


if __name__ == "__main__":
    main()
