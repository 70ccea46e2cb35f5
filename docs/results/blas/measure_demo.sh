#!/usr/bin/env bash
# `dflash2 run` on the demo pair under each BLAS, alternating, ROUNDS times; one JSON line per run.
# Usage: DFLASH2=/path/to/venv/bin/dflash2 MKL_RT=/path/lib/libmkl_rt.so.3 ROUNDS=3 ./measure_demo.sh > demo.jsonl
set -euo pipefail
DFLASH2=${DFLASH2:-dflash2}
ROUNDS=${ROUNDS:-3}
PROMPT="Why is the sky blue?"
export HF_HUB_OFFLINE=1
run() {  # name, then env assignments; the demo pair (DFlash 2, block 4), then plain decoding
  local name=$1; shift
  for drafter in default none; do
    local extra=(); [ "$drafter" = none ] && extra=(--drafter none)
    env -u LD_PRELOAD -u DFLASH2_OPENBLAS "$@" "$DFLASH2" run "$PROMPT" --max-tokens 64 "${extra[@]}" --json \
      2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'option': '$name', \
'drafter': '$drafter', 'decode_tps': r['decode_tps'], 'prompt_tps': r['prompt_tps'], 'tau': r['tau']}))"
  done
}
for r in $(seq "$ROUNDS"); do
  run system-openblas DFLASH2_NO_OPENBLAS=0
  run faiss-openblas DFLASH2_BLAS_IGNORE_SYSTEM=1
  [ -n "${MKL_RT:-}" ] && run mkl-sequential DFLASH2_OPENBLAS="$MKL_RT"
  run reference DFLASH2_NO_OPENBLAS=1
done
