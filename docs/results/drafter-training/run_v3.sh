#!/usr/bin/env bash
# The demo drafter's recipe-v3 run (issue 22), as run; every stage resumes where it stopped.
# Run from the repository root with the venv's dflash2 on PATH. Progress: data/*/progress.jsonl
# (one line per finished segment) and the fit runs' train_log.jsonl.
set -euo pipefail
D=docs/results/drafter-training/data
TAPS=1,8,14,20,27,29   # a superset: fit --taps picks the set the A/B chose

# 1. On-policy data: 16,384 prompts (ShareGPT first and later turns, stdlib code tasks, templated
#    maths), 1,024 per segment, the target's greedy answers (<= 160 tokens) with taps and top-32
#    log-probs captured as it generates. One worker per core; rerun to resume. tokens/ is
#    committed; feat/ is rebuilt from it on a new machine with --rebuild-features.
stage_data() {
  for k in 0 1; do
    dflash2 train prepare-data smollm2-demo --out $D/pool --n-prompts 16384 --taps $TAPS --worker $k/2 &
  done
  wait
}
rebuild_features() {
  for k in 0 1; do
    dflash2 train prepare-data smollm2-demo --out $D/pool --n-prompts 16384 --taps $TAPS --rebuild-features \
        --worker $k/2 &
  done
  wait
  dflash2 train prepare-data smollm2-demo --out $D/eval --heldout --n-prompts 128 --segment-size 64 \
      --taps $TAPS --exclude $D/pool --rebuild-features
}
# The held-out evaluation set: 128 prompts of the same mix from the other end of ShareGPT and
# another seed stream, none equal to a pool prompt.
stage_eval() {
  for k in 0 1; do
    dflash2 train prepare-data smollm2-demo --out $D/eval --heldout --n-prompts 128 --segment-size 64 \
        --taps $TAPS --exclude $D/pool --worker $k/2 &
  done
  wait
}

# 2. A/B arms at small scale (segments 0-1: 2,048 sequences), two seeds, two runs side by side.
stage_ab() {
  python docs/results/drafter-training/recipe_ab.py --data $D/pool --eval $D/eval --shards 'onp-0000[01]-*' \
      --arms base,b4,kl,tied --seeds 0,1 --steps 400 --b4-steps 650 --eval-every 400 --parallel 2 \
      --out runs/ab --json docs/results/drafter-training/ab_round1.json
}

case "${1:-all}" in
  data) stage_data ;;
  eval) stage_eval ;;
  rebuild) rebuild_features ;;
  ab) stage_ab ;;
  all) stage_data; stage_eval; stage_ab ;;
  *) echo "usage: $0 [data|eval|rebuild|ab|all]" >&2; exit 2 ;;
esac
