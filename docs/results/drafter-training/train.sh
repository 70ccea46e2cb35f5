#!/usr/bin/env bash
# The demo drafters' training, as run for models/smollm2-135m-dflash{,2} (see their cards).
# Stages are resumable: rerun the same command after an interruption.
set -euo pipefail
RUNS=${RUNS:-runs}
D="dflash2 train"
# 1. Data: teacher-forced ShareGPT conversations + stdlib sources (eval suites filtered out) ...
$D teacher-data smollm2-demo --out $RUNS/smol --n-docs ${N_DOCS:-1280} --shard-size 128 --taps 1,8,14,20,27
# ... and a held-out evaluation set of the target's own answers (prompts teacher-data never reaches).
$D prepare-data smollm2-demo --out $RUNS/smol-eval --heldout --n-prompts 64 --max-new-tokens 128 \
    --batch-size 64 --shard-size 64 --taps 1,8,14,20,27
# 2. Fit both drafters the same way (warm-started from the previous demo drafters, trained over the
#    8,192-id proposal vocab the drafters draft with), side by side, one BLAS thread each.
VOCAB=models/smollm2-135m-dflash2/proposal_vocab.json
COMMON="smollm2-demo --data $RUNS/smol --eval-data $RUNS/smol-eval --holdout-shards 0 --steps ${STEPS:-600}
  --seqs 4 --anchors 64 --lr 3e-4 --eval-every 50 --save-every 25 --seed 0 --train-vocab $VOCAB
  --train-vocab-size 8192"
OPENBLAS_NUM_THREADS=1 $D fit $COMMON --arch dflash2 --warm-start models/smollm2-135m-dflash2 \
    --ce-weight 0.1 --selector-weight 0.1 --selector-tv-weight 0.9 --out $RUNS/main-dflash2 &
OPENBLAS_NUM_THREADS=1 $D fit $COMMON --arch dflash --warm-start models/smollm2-135m-dflash --out $RUNS/main-dflash &
wait
