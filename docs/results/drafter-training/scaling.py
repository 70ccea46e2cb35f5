"""Scaling tables from `dflash2 train fit` runs: held-out estimated τ against steps, and against data size.

Usage: python scaling.py RUN_DIR... [--json out.json]
    e.g. python scaling.py scaling-logs/tf-* scaling-logs/onp-*
Each RUN_DIR holds a train_log.jsonl (or .jsonl.gz); rows with eval metrics give (step, eval_tau_est). The data
(directory, sequences, trainable tokens) and arch are read from RUN_DIR/data.json, which `fit` writes.
"""

import argparse
import gzip
import json
from pathlib import Path


def log_lines(path: Path) -> list[str]:
    """RUN_DIR/train_log.jsonl, or the .jsonl.gz kept in scaling-logs/."""
    plain = path / "train_log.jsonl"
    return (plain.read_text() if plain.exists() else gzip.open(path / "train_log.jsonl.gz", "rt").read()).splitlines()


def read_run(path: Path) -> dict:
    data = json.loads((path / "data.json").read_text())
    source = Path(data["train_shards"][0]).parent.parent.name
    meta = {"arch": data["arch"], "data": source, "seqs": data["sequences"], "tokens": data["trainable_tokens"],
            "eval": Path(data["eval_shards"][0]).parent.parent.name}
    evals, secs = [], 0.0
    for line in log_lines(path):
        row = json.loads(line)
        secs += row.get("seconds", 0)
        if "eval_tau_est" in row:
            acc = row.get("eval_pick", row.get("eval_top1"))
            evals.append({"step": row["step"], "eval_tau_est": round(row["eval_tau_est"], 3),
                          "eval_acc1": round(acc[0], 3)})
    return {"run": path.name, **meta, "evals": evals, "train_seconds": round(secs, 1)}


def steps_table(runs: list[dict]) -> None:
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    print("| run | arch | data | sequences | trainable tokens | " + " | ".join(f"@{s}" for s in steps) + " | train s |")
    print("|---|---|---|---|---|" + "---|" * len(steps) + "---|")
    for r in runs:
        by = {e["step"]: e["eval_tau_est"] for e in r["evals"]}
        print(f"| {r['run']} | {r['arch']} | {r['data']} | {r['seqs']} | {r['tokens']} | "
              + " | ".join(f"{by[s]:.3f}" if s in by else "–" for s in steps) + f" | {r['train_seconds']:.0f} |")


def size_table(runs: list[dict]) -> None:
    """τ̂ at each run's last eval, one row per (data, arch), one column per sequence count."""
    sizes = sorted({r["seqs"] for r in runs})
    print("| data | arch | " + " | ".join(f"{n} seqs" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for key in sorted({(r["data"], r["arch"]) for r in runs}):
        by = {r["seqs"]: r["evals"][-1]["eval_tau_est"] for r in runs if (r["data"], r["arch"]) == key and r["evals"]}
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{by[n]:.3f}" if n in by else "–" for n in sizes) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [read_run(p) for p in args.runs if any((p / f"train_log.jsonl{z}").exists() for z in ("", ".gz"))]
    steps_table(runs)
    print()
    size_table(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
