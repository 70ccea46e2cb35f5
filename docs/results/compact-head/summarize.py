"""Table of propose.json + bench-vocab-*.json (made by measure_propose.py, measure_bench.sh) -> summary.json.

    .venv/bin/python docs/results/compact-head/summarize.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent


def main():
    propose = json.loads((HERE / "propose.json").read_text())["rows"]
    ms = {(r["draft_vocab"], r["block"]): r for r in propose}
    bench = {}
    for f in sorted(HERE.glob("bench-vocab-*.json")):
        size = int(f.stem.split("-")[-1])
        overall = json.loads(f.read_text())["summary"]["overall"]
        bench[size or 49152] = {"tau": overall["dflash2@4"]["tau"], "decode_tps": overall["dflash2@4"]["decode_tps"],
                                "ar_decode_tps": overall["ar"]["decode_tps"], "speedup": overall["dflash2@4"]["speedup"],
                                "acceptance_by_position": overall["dflash2@4"]["acceptance_by_position"],
                                "n_mismatch_vs_ar": overall["dflash2@4"]["n_mismatch_vs_ar"]}
    rows = []
    for size in sorted({r["draft_vocab"] for r in propose}, reverse=True):
        b = bench.get(size, {})
        rows.append({"draft_vocab": size, "propose_ms_b4": ms[size, 4]["median_ms"],
                     "propose_ms_b8": ms[size, 8]["median_ms"], "spread_ms_b4": ms[size, 4]["spread_ms"],
                     "spread_ms_b8": ms[size, 8]["spread_ms"], "coverage_heldout": ms[size, 4]["coverage_heldout"],
                     **{f"bench_{k}": v for k, v in b.items()}})
    print("| draft vocab | held-out coverage | propose ms, block 4 | propose ms, block 8 | τ (dflash2@4) "
          "| dflash2@4 tok/s | AR tok/s (same run) | mismatches vs AR |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tau = f"{r['bench_tau']:.3f}" if "bench_tau" in r else "–"
        tps = f"{r['bench_decode_tps']:.2f}" if "bench_decode_tps" in r else "–"
        ar = f"{r['bench_ar_decode_tps']:.2f}" if "bench_ar_decode_tps" in r else "–"
        mm = r.get("bench_n_mismatch_vs_ar", "–")
        print(f"| {r['draft_vocab']}{' (full)' if r['draft_vocab'] == 49152 else ''} | {r['coverage_heldout']:.1%} "
              f"| {r['propose_ms_b4']:.1f} (±{r['spread_ms_b4'] / 2:.1f}) | {r['propose_ms_b8']:.1f} "
              f"(±{r['spread_ms_b8'] / 2:.1f}) | {tau} | {tps} | {ar} | {mm} |")
    (HERE / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
