#!/usr/bin/env bash
# τ and tok/s of the demo pair with the full head (--draft-vocab 0) and the compact head (8192, 16384).
# Usage: DFLASH2=.venv/bin/dflash2 ./docs/results/compact-head/measure_bench.sh
set -euo pipefail
DFLASH2=${DFLASH2:-dflash2}
OUT=$(dirname "$0")
export HF_HUB_OFFLINE=1
for size in 0 8192 16384; do
  "$DFLASH2" bench --modes ar,dflash2@4 --n 4 --max-tokens 128 --draft-vocab "$size" \
    --json "$OUT/bench-vocab-$size.json" > "$OUT/bench-vocab-$size.txt" 2>&1
done
