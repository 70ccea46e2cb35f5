#!/usr/bin/env bash
# Held-out figures for the demo drafter cards and the issue notes (run on a quiet machine).
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
. .venv/bin/activate
# The bench/diagnose commands that produced the files next to this script (~30 min, 2 cores).
export HF_HUB_OFFLINE=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 COLUMNS=160
OUT=${OUT:-runs/smollm2/results}
mkdir -p $OUT
P="Why is the sky blue? Answer in two sentences."
# 0. dflash2 run: plain vs DFlash 2 vs DFlash v1 (greedy, same text)
dflash2 run "$P" --max-tokens 128 --drafter none --json > $OUT/run_ar.json
dflash2 run "$P" --max-tokens 128 --json > $OUT/run_dflash2.json
dflash2 run smollm2-demo-v1 "$P" --max-tokens 128 --json > $OUT/run_dflash.json
dflash2 run "$P" --max-tokens 64 > $OUT/run_plain.txt 2>&1
# 1. held-out tau (greedy, block 8) for v1 and v2 + speed vs AR, all five suites
dflash2 bench --suite gsm8k,math500,humaneval,mbpp,mtbench --n 6 --max-tokens 128 --modes ar,dflash,dflash2 \
  --block-size 8 --json $OUT/bench_b8.json --plot $OUT/accept_b8.png > $OUT/bench_b8.txt 2>&1
# 2. fixed vs auto block sizes (DFlash 2)
dflash2 bench --suite gsm8k,humaneval,mtbench --n 4 --max-tokens 128 \
  --modes ar,dflash2@2,dflash2@4,dflash2@8,dflash2@auto --json $OUT/bench_auto.json > $OUT/bench_auto.txt 2>&1
# 3. the diagnose table
dflash2 diagnose --suite gsm8k,humaneval,mtbench --n 4 --max-tokens 128 --block-size 8 \
  --json $OUT/diagnose.json > $OUT/diagnose.txt 2>&1
echo MEASURE DONE
