"""A/B arms of the drafter recipe at small scale: each arm is `dflash2 train fit` with the
baseline's flags plus its own, run for each seed; the table compares every arm to the baseline
of the same seed on the held-out exact simulated acceptance (τ of the decoding walk and the mean
over all anchors, at block 4 and 8).

Decision rule (issue 22): adopt an arm when both seeds gain and the mean gain is >= 0.03 τ@4.

    python recipe_ab.py --data runs/pool --eval runs/eval --arms base,kl,dpace --seeds 0,1 \\
        --steps 600 --parallel 2 --out runs/ab --json ab.json

Runs already finished (their OUT holds config.json) are not rerun; `--report` only prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VOCAB = "models/smollm2-135m-dflash2/proposal_vocab.json"
BASE = (f"--arch dflash2 --layers 2 --block-size 8 --seqs 2 --anchors 64 --lr 1e-3 --schedule wsd --mask-token-id 16 "
        f"--train-vocab {VOCAB} --train-vocab-size 8192 --taps 1,8,14,20,27")
# arm: (its flags on top of BASE, the arm it is compared with)
ARMS = {
    "base": ("", None),
    "b4": ("--block-size 4", "base"),  # steps scaled to equal time by --b4-steps
    "kl": ("--kl-weight 0.5 --ce-weight 0.5", "base"),
    "dpace": ("--dpace", "base"),
    "sched": ("--ce-weight 1.0 --ce-weight-end 0.1 --selector-weight 0.1 --selector-tv-weight 0.1 "
              "--selector-tv-weight-end 0.9 --inject-gold", "base"),
    "tied": ("--tie-codebooks", "base"),
    "taps29": ("--taps 1,8,14,20,27,29", "base"),
    # the prompt mix at equal trainable tokens: ShareGPT turns only vs the whole mix
    "mix-eq": ("--max-trainable 150000", None),
    "sharegpt-eq": ("--sources sharegpt,turns --max-trainable 150000", "mix-eq"),
}


def run_arm(arm: str, seed: int, args) -> Path:
    out = Path(args.out) / f"{arm}-s{seed}"
    if (out / "config.json").exists():
        return out
    steps = args.b4_steps if arm == "b4" and args.b4_steps else args.steps
    extra = ARMS[arm][0] if arm in ARMS else arm
    cmd = (f"{args.dflash2} train fit smollm2-demo --data {args.data} --eval-data {args.eval} --holdout-shards 0 "
           f"{BASE} {extra} --steps {steps} --eval-every {args.eval_every} --save-every {args.eval_every} "
           f"--eval-blocks 4,8 --seed {seed} --out {out} --shards '{args.shards}'")
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(cmd + "\n")
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with open(out / "fit.log", "w") as log:
        subprocess.run(shlex.split(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return out


def last_eval(out: Path) -> dict | None:
    log = out / "train_log.jsonl"
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_b4_tau" in r]
    if not evals:
        return None
    r = evals[-1]
    return {"step": r["step"], "seconds": round(sum(x["seconds"] for x in rows), 1),
            **{f"{k}@{b}": r[f"eval_b{b}_{k}"] for b in (4, 8) for k in ("tau", "tau_all")},
            "by_source@4": {g: v["tau_all"] for g, v in r.get("eval_b4_by_group", {}).items()}}


def table(args) -> dict:
    results = {}
    for arm in args.arms:
        for seed in args.seeds:
            results[f"{arm}-s{seed}"] = last_eval(Path(args.out) / f"{arm}-s{seed}")
    print("| arm | seed | steps | train s | τ@4 walk | τ@4 all | τ@8 walk | τ@8 all | Δτ@4 all vs its baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    decisions = {}
    for arm in args.arms:
        deltas, versus = [], ARMS.get(arm, ("", "base"))[1]
        for seed in args.seeds:
            r, b = results[f"{arm}-s{seed}"], results.get(f"{versus}-s{seed}")
            if r is None:
                print(f"| {arm} | {seed} | – | – | – | – | – | – | – |")
                continue
            d = None if b is None or versus is None else r["tau_all@4"] - b["tau_all@4"]
            if d is not None:
                deltas.append(d)
            print(f"| {arm} | {seed} | {r['step']} | {r['seconds']:.0f} | {r['tau@4']:.3f} | {r['tau_all@4']:.3f} | "
                  f"{r['tau@8']:.3f} | {r['tau_all@8']:.3f} | {'' if d is None else f'{d:+.3f}'} |")
        if versus is not None and len(deltas) == len(args.seeds):
            agree = all(d > 0 for d in deltas) or all(d < 0 for d in deltas)
            mean = sum(deltas) / len(deltas)
            decisions[arm] = {"versus": versus, "mean_delta_tau_all@4": round(mean, 4), "seeds_agree": agree,
                              "adopt": agree and mean >= 0.03}
    for arm, d in decisions.items():
        print(f"{arm} vs {d['versus']}: mean Δτ@4 {d['mean_delta_tau_all@4']:+.3f}, seeds agree: {d['seeds_agree']} -> "
              f"{'adopt' if d['adopt'] else 'keep the baseline'}")
    return {"runs": results, "decisions": decisions, "base_flags": BASE,
            "arms": {a: ARMS.get(a, (a, "base"))[0] for a in args.arms}, "steps": args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--shards", default="*", help="which DATA/feat shards (glob), e.g. 'onp-0000[01]-*'")
    ap.add_argument("--arms", default="base,kl", type=lambda s: s.split(","))
    ap.add_argument("--seeds", default="0,1", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--b4-steps", type=int, default=0, help="steps of the b4 arm (equal CPU time)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--out", default="runs/ab")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", action="store_true", help="only print the table of finished runs")
    ap.add_argument("--dflash2", default=str(Path(sys.executable).parent / "dflash2"))
    args = ap.parse_args()
    if not args.report:
        jobs = [(a, s) for s in args.seeds for a in args.arms]
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda job: run_arm(*job, args), jobs))
    result = table(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
