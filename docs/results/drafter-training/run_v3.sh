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
# SEGMENTS (e.g. 6-9) limits the rebuild to the segments a run reads (default: every done one).
rebuild_features() {
  for k in 0 1; do
    dflash2 train prepare-data smollm2-demo --out $D/pool --n-prompts 16384 --taps $TAPS --rebuild-features \
        ${SEGMENTS:+--segments $SEGMENTS} --worker $k/2 &
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

# 3. The long run: warm-started from a drafter (WARM, default the shipped one: v3 started from v2,
#    v4 from v3), trained at block 4 (A/B round 1), WSD at lr 1e-3 with a long stable phase; STEPS
#    sets where the decay ends (the last 20 %), and a resume with a smaller STEPS starts the decay
#    early (the rate before it does not depend on STEPS).
#    v3: STEPS=4450 (resumed from 20000 at step 2,250), SHARDS='onp-0000[0-3]-*', WARM = v2.
#    v4: STEPS=3125 (resumed from 3800 at the step-2,500 checkpoint), SHARDS='onp-0000[0-5]-*',
#        OUT=runs/v4-long, WARM = v3 (`git archive 37b5f81 models/smollm2-135m-dflash2 | tar -x -C /tmp/v3`).
#    v5 (started 2026-12-03 17:22): STEPS=6000 SHARDS='onp-0000[0-9]-*' OUT=runs/v5-long,
#        WARM = v4 (models/smollm2-135m-dflash2 at f9af743, exported); segments 6-9 rebuilt with `rebuild`.
#        Lost at step 1,750 with its machine (checkpoints are not committed).
#    v5b (2026-12-03, stop 32, on a fresh machine): SEGMENTS=6-9 run_v3.sh rebuild (two cores, ~70 min
#        while tests shared them), then two arms side by side, one core each, warm from v4
#        (models/smollm2-135m-dflash2 at 72cbfb5) on the four segments v4 never saw:
#          A: STEPS=2500 SHARDS='onp-0000[6-9]-*' OUT=runs/v5b
#          B: the same with LR=3e-4 OUT=runs/v5b-lr3e-4
#        both stopped and resumed with STEPS=2000 (A at its step-1,500 checkpoint, B at 1,250) so the
#        decay ended inside the session.
#    v6 (2026-12-04, stop 34, fresh machine): segments 10-15 generated at stop 33 (two workers, ~4.5 CPU-h);
#        SEGMENTS=10-15 run_v3.sh rebuild stopped after 10-13 (two workers, 76 min, ~2.2 CPU-h; 14-15 are
#        rebuilt the same way next time), the eval set rebuilt (4 min), then warm from v5
#        (models/smollm2-135m-dflash2 at b18d74e) on the four segments v5 never saw, one core:
#          WARM=models/smollm2-135m-dflash2 LR=3e-4 STEPS=2000 SHARDS='onp-0001[0-3]-*' OUT=runs/v6
#        resumed at its step-500 checkpoint with STEPS=1500 so the decay ended inside the session.
#    v7 arms (2026-12-04, stop 35): v6's run with one recipe change each, EXTRA='--dpace' and
#        EXTRA='--kl-weight 0.5 --ce-weight 0.5', OUT=runs/v7-<arm>, STEPS=2000 stopped at the step-500
#        checkpoint and resumed with STEPS=1500, as v6 was; two side by side, one core each.
stage_long() {
  dflash2 train fit smollm2-demo --data $D/pool --eval-data $D/eval --holdout-shards 0 --arch dflash2 \
      --warm-start "${WARM:-models/smollm2-135m-dflash2}" --block-size 4 --seqs 2 --anchors 64 --lr "${LR:-1e-3}" --schedule wsd \
      --train-vocab models/smollm2-135m-dflash2/proposal_vocab.json --train-vocab-size 8192 --taps 1,8,14,20,27 \
      --steps "${STEPS:-20000}" --eval-every 1000 --save-every 250 --eval-blocks 4,8 --seed 0 \
      --out "${OUT:-runs/v3-long}" --shards "${SHARDS:-onp-0000[0-3]-*}" --resume ${EXTRA:-}
}

case "${1:-all}" in
  data) stage_data ;;
  eval) stage_eval ;;
  rebuild) rebuild_features ;;
  ab) stage_ab ;;
  long) stage_long ;;
  all) stage_data; stage_eval; stage_ab ;;
  *) echo "usage: $0 [data|eval|rebuild|ab|long|all]" >&2; exit 2 ;;
esac
