#!/usr/bin/env bash
# From-scratch scaling runs: v2 and v1 at 48 / 160 / 493 sequences, same steps (data-size axis; STEPS, default 300).
set -euo pipefail  # from the repository root; RUNS as in train.sh
V=models/smollm2-135m-dflash2/proposal_vocab.json
for N in 48 160 493; do
  C="smollm2-demo --data ${RUNS:-runs}/smol --eval-data ${RUNS:-runs}/smol-eval --holdout-shards 0 --max-seqs $N --layers 2
     --block-size 8 --steps ${STEPS:-300} --seqs 2 --anchors 64 --lr 1e-3 --eval-every 50 --save-every 50 --seed 0
     --mask-token-id 16 --train-vocab $V --train-vocab-size 8192"
  OPENBLAS_NUM_THREADS=1 dflash2 train fit $C --arch dflash2 --ce-weight 0.1 --selector-weight 0.1 \
      --selector-tv-weight 0.9 --out ${RUNS:-runs}/scale-dflash2-$N > ${RUNS:-runs}/scale-dflash2-$N.log 2>&1 &
  OPENBLAS_NUM_THREADS=1 dflash2 train fit $C --arch dflash --out ${RUNS:-runs}/scale-dflash-$N > ${RUNS:-runs}/scale-dflash-$N.log 2>&1 &
  wait
done

