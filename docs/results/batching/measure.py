"""Aggregate tok/s and per-request latency against concurrency: `dflash2 serve` vs `mlx_lm.server`.

Both servers on the demo target side by side (the dflash2 CLI's fast BLAS preloaded for both),
levels interleaved: at each concurrency C, C streaming clients start together on C different
held-out prompts (the bundled MT-Bench, GSM8K, HumanEval, MATH-500 and MBPP samples in turn),
never sent before in the run (both servers cache prompts), with the chat template, greedy, `--max-tokens`
each; aggregate tok/s = all completion tokens / the round's wall time; latency = request sent →
last token. A warm-up round runs first on each server. Prints a table, writes JSON and a PNG.

    .venv/bin/python docs/results/batching/measure.py --json docs/results/batching/result-run2.json \\
        --png docs/results/batching/throughput.png

Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prefix-cache"))
from measure import BIN, blas_env, servers_up  # noqa: E402  (the prefix-cache benchmark's server helpers)

LEVELS = (1, 2, 4, 8, 16)


SUITES = ("mtbench", "gsm8k", "humaneval", "math500", "mbpp")


def prompts(n: int) -> list[str]:
    """n held-out prompts, taken in turn from the five bundled suites (60 in all)."""
    from dflash2_mlx.prompts import load_suite

    suites = [load_suite(name, 12, bundled_only=True).prompts for name in SUITES]
    texts = [p.text for group in zip(*suites) for p in group]
    if n > len(texts):
        raise SystemExit(f"{n} prompts asked for, {len(texts)} bundled")
    return texts[:n]


def one(client, model, text, max_tokens) -> dict:
    t0 = time.perf_counter()
    n, usage, ttft = 0, None, None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            n += 1
            ttft = time.perf_counter() - t0 if ttft is None else ttft
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft,
            "tokens": usage.completion_tokens if usage else n}


def round_(client, model, texts, max_tokens) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        done = list(pool.map(lambda t: one(client, model, t, max_tokens), texts))
    wall = time.perf_counter() - t0
    tokens = sum(d["tokens"] for d in done)
    return {"concurrency": len(texts), "wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall,
            "p50_latency_s": statistics.median(d["latency_s"] for d in done),
            "p95_ttft_s": p95([d["ttft_s"] for d in done if d["ttft_s"] is not None])}


def p95(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))] if values else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=None, help="ours; default: the server's own")
    ap.add_argument("--also-max-batch", type=int, default=None,
                    help="a third server: ours at this --max-batch (e.g. 8, the old default)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies, e.g. 1,2,4")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per level (each reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--logs", default="/tmp/batching-logs")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    from dflash2_mlx import hub

    spec = hub.resolve(None, None)
    env = blas_env()
    ours = [str(BIN / "dflash2"), "serve"]
    servers = {"dflash2 serve": ours + ([] if args.max_batch is None else ["--max-batch", str(args.max_batch)]),
               "mlx_lm.server": [str(BIN / "python"), "-m", "mlx_lm.server", "--model", str(spec.target)]}
    if args.also_max_batch is not None:
        servers[f"dflash2 --max-batch {args.also_max_batch}"] = ours + ["--max-batch", str(args.also_max_batch)]
    levels = [int(x) for x in args.levels.split(",")]
    # Every round gets prompts no earlier round sent: both servers keep prompt caches, and a
    # repeated prompt would measure those instead of batching.
    texts = iter(prompts(4 + args.repeats * sum(levels)))
    warm = [next(texts) for _ in range(4)]
    rows = {name: [] for name in servers}
    with servers_up(servers, env, logs, timeout=900) as (clients, models):
        for name in servers:
            round_(clients[name], models[name], warm, 16)  # warm-up
        for c in levels:
            for _ in range(args.repeats):
                batch = [next(texts) for _ in range(c)]  # the same fresh prompts for both servers
                for name in servers:
                    r = round_(clients[name], models[name], batch, args.max_tokens)
                    rows[name].append(r)
                    print(f"{name:24s} C={c:2d} aggregate {r['aggregate_tps']:6.1f} tok/s  p50 latency "
                          f"{r['p50_latency_s']:6.2f} s  p95 TTFT {r['p95_ttft_s']:6.2f} s", flush=True)
    report(rows, args)


def report(rows: dict, args) -> None:
    ref = rows["mlx_lm.server"]
    for name, ours in rows.items():
        if name == "mlx_lm.server":
            continue
        print(f"\n{name} against mlx_lm.server")
        print(f"{'C':>3} {'ours tok/s':>10} {'mlx_lm tok/s':>12} {'ratio':>6} {'ours p50':>9} {'mlx_lm p50':>10} "
              f"{'p50 ratio':>9} {'ours p95 TTFT':>13} {'mlx_lm p95 TTFT':>15}")
        for o, r in zip(ours, ref):
            print(f"{o['concurrency']:>3} {o['aggregate_tps']:>10.1f} {r['aggregate_tps']:>12.1f} "
                  f"{o['aggregate_tps'] / r['aggregate_tps']:>6.2f} {o['p50_latency_s']:>8.2f}s "
                  f"{r['p50_latency_s']:>9.2f}s {o['p50_latency_s'] / r['p50_latency_s']:>9.2f} "
                  f"{o['p95_ttft_s']:>12.2f}s {r['p95_ttft_s']:>14.2f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "max_batch": args.max_batch,
                                               "rows": rows}, indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, data in rows.items():
            ax.plot([d["concurrency"] for d in data], [d["aggregate_tps"] for d in data], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title("demo pair, 2-core CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
