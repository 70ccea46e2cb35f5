#!/usr/bin/env bash
# From-scratch scaling runs: v2 and v1 side by side (one BLAS thread each) at each data size, the same
# steps and settings, evaluated on the held-out set every 50 steps (the τ̂-vs-steps axis).
#   DATA   prepared data (teacher-data or prepare-data output)    default runs/smol
#   EVAL   held-out set (prepare-data --heldout)                  default runs/smol-eval
#   SIZES  training sequences per run                             default "48 160 493"
#   TAG    run name prefix                                        default scale
#   STEPS  optimizer steps (2 sequences x 64 anchors each)        default 300
set -euo pipefail  # from the repository root, with dflash2 on PATH
RUNS=${RUNS:-runs}; DATA=${DATA:-$RUNS/smol}; EVAL=${EVAL:-$RUNS/smol-eval}; TAG=${TAG:-scale}
V=models/smollm2-135m-dflash2/proposal_vocab.json
for N in ${SIZES:-48 160 493}; do
  C="smollm2-demo --data $DATA --eval-data $EVAL --holdout-shards 0 --max-seqs $N --layers 2
     --block-size 8 --steps ${STEPS:-300} --seqs 2 --anchors 64 --lr 1e-3 --eval-every 50 --save-every 50 --seed 0
     --mask-token-id 16 --train-vocab $V --train-vocab-size 8192 --resume"
  OPENBLAS_NUM_THREADS=1 dflash2 train fit $C --arch dflash2 --ce-weight 0.1 --selector-weight 0.1 \
      --selector-tv-weight 0.9 --out $RUNS/$TAG-dflash2-$N > $RUNS/$TAG-dflash2-$N.log 2>&1 &
  OPENBLAS_NUM_THREADS=1 dflash2 train fit $C --arch dflash --out $RUNS/$TAG-dflash-$N > $RUNS/$TAG-dflash-$N.log 2>&1 &
  wait
done
