#!/usr/bin/env bash
# Issue 23 A/B: the one-decoder HEAD vs eea0bf1 (two engines), before then after, same machine, quiet.
# BEFORE: a worktree of eea0bf1 (`git worktree add /tmp/before eea0bf1`), the last commit with two engines.
set -euo pipefail
cd "$(dirname "$0")/../../.."
ARGS="bench smollm2-demo --suite gsm8k,math500,humaneval,mbpp,mtbench --n 2 --max-tokens 96 --modes mlx_lm,ar,dflash2@4"
for round in 1; do
  PYTHONPATH=${BEFORE:-/tmp/before} .venv/bin/dflash2 $ARGS --json docs/results/one-decoder/before-$round.json > docs/results/one-decoder/before-$round.txt 2>&1
  .venv/bin/dflash2 $ARGS --json docs/results/one-decoder/after-$round.json > docs/results/one-decoder/after-$round.txt 2>&1
done
