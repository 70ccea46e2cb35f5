"""The long-context table and PNG from `dflash2 bench --context ... --json` files (issue 26).

    python docs/results/long-context/plot.py OUT.png RUN.json [RUN.json ...]

Per run file (one K/V setting) and context length: each mode's prefill tok/s, TTFT, decode tok/s,
τ, peak memory, and the decode and prefill ratios to `mlx_lm` and to our plain decoding (`ar`).
The PNG plots decode tok/s against context, one line per mode and K/V setting.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def rows(run: dict) -> list[dict]:
    kv = kv_bits = run["settings"].get("kv_bits") or "fp"
    if run["settings"].get("turn_tokens"):  # prefill figures are the turn's last tokens (--turn-tokens)
        kv = f"{kv}, turn of {run['settings']['turn_tokens']}"
    out = []
    for suite, modes in run["summary"]["by_suite"].items():
        context = int(suite.split("-")[-1])
        ref, plain = modes.get("mlx_lm"), modes.get("ar")
        for mode, m in modes.items():
            out.append({
                "kv": kv, "kv_bits": kv_bits, "context": context, "mode": mode,
                "prompt_tokens": m["n_prompt_tokens"] // _prefills(run, suite, mode),
                "prefill_tps": m["prompt_tps"], "ttft_s": m["ttft_s"], "decode_tps": m["decode_tps"],
                "tau": m["tau"], "peak_gb": m["peak_memory_gb"], "mismatch_vs_ar": m["n_mismatch_vs_ar"],
                "decode_x_mlx_lm": m["decode_tps"] / ref["decode_tps"] if ref else None,
                "prefill_x_mlx_lm": m["prompt_tps"] / ref["prompt_tps"] if ref else None,
                "decode_x_ar": m["decode_tps"] / plain["decode_tps"] if plain else None,
                "kv_bytes_per_token": run["settings"].get("kv_cache_bytes_per_token"),
            })
    return out


def _prefills(run: dict, suite: str, mode: str) -> int:
    """Runs that prefilled more than the last token (a --repeats repeat decodes from its prompt cache)."""
    return sum(1 for r in run["runs"] if r["suite"] == suite and r["mode"] == mode
               and r["n_prompt_tokens"] - r.get("n_cached", 0) > 1)


def table(all_rows: list[dict]) -> str:
    head = ("| K/V | context | mode | prefill tok/s | TTFT s | decode tok/s | τ | peak GB | decode × mlx_lm "
            "| prefill × mlx_lm | decode × ar | ≠ plain |")
    lines = [head, "|" + "|".join("---" for _ in range(12)) + "|"]
    fmt = lambda x, d=2: "—" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in sorted(all_rows, key=lambda r: (str(r["kv"]), r["context"], r["mode"])):
        lines.append(f"| {r['kv']} | {r['prompt_tokens']} | {r['mode']} | {fmt(r['prefill_tps'], 0)} | "
                     f"{fmt(r['ttft_s'], 1)} | {fmt(r['decode_tps'])} | {fmt(r['tau'])} | {fmt(r['peak_gb'])} | "
                     f"{fmt(r['decode_x_mlx_lm'])} | {fmt(r['prefill_x_mlx_lm'])} | {fmt(r['decode_x_ar'])} | "
                     f"{r['mismatch_vs_ar']} |")
    return "\n".join(lines)


def plot(all_rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    # a --turn-tokens run decodes at the full context like any other: one line per mode and K/V bits
    for key in sorted({(str(r["kv_bits"]), r["mode"]) for r in all_rows}):
        pts = sorted((r["prompt_tokens"], r["decode_tps"]) for r in all_rows if (str(r["kv_bits"]), r["mode"]) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[1]} (K/V {key[0]})")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode tok/s")
    ax.set_title("Decode speed against context (modes interleaved within each run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    out, paths = Path(sys.argv[1]), sys.argv[2:]
    all_rows = [r for p in paths for r in rows(load(p))]
    print(table(all_rows))
    for p in paths:
        run = load(p)
        print(f"{p}: K/V {run['settings'].get('kv_bits') or 'fp'}, "
              f"{run['settings'].get('kv_cache_bytes_per_token')} bytes per token of context")
    plot(all_rows, out)


if __name__ == "__main__":
    main()
