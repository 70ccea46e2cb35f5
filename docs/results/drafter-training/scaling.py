"""Scaling table from `dflash2 train fit` runs: held-out estimated τ against data size and steps.

Usage: python scaling.py RUN_DIR... [--json out.json]
Each RUN_DIR holds a train_log.jsonl; rows with eval metrics give (step, eval_tau_est). The data
size and arch are read from RUN_DIR/data.json, which `fit` writes.
"""

import argparse
import json
from pathlib import Path


def read_run(path: Path) -> dict:
    data = json.loads((path / "data.json").read_text())
    meta = {"arch": data["arch"], "seqs": data["sequences"], "tokens": data["trainable_tokens"]}
    evals = []
    for line in (path / "train_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval_tau_est" in row:
            acc = row.get("eval_pick", row.get("eval_top1"))
            evals.append({"step": row["step"], "eval_tau_est": round(row["eval_tau_est"], 3),
                          "eval_acc1": round(acc[0], 3), })
    secs = sum(json.loads(line).get("seconds", 0) for line in (path / "train_log.jsonl").read_text().splitlines())
    return {"run": path.name, **meta, "evals": evals, "train_seconds": round(secs, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [read_run(p) for p in args.runs if (p / "train_log.jsonl").exists()]
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    print("| run | arch | sequences | trainable tokens | " + " | ".join(f"τ̂ @{s}" for s in steps) + " | train s |")
    print("|---|---|---|---|" + "---|" * len(steps) + "---|")
    for r in runs:
        by = {e["step"]: e["eval_tau_est"] for e in r["evals"]}
        print(f"| {r['run']} | {r.get('arch', '?')} | {r.get('seqs', '?')} | {r.get('tokens', '?')} | "
              + " | ".join(f"{by[s]:.3f}" if s in by else "–" for s in steps) + f" | {r['train_seconds']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
