#!/usr/bin/env bash
# 1 rank vs 2 ranks (ring on loopback, this 2-core machine) on Qwen2.5-Coder-0.5B: plain, and a
# random DFlash 2 drafter at width 4 (tau ~1: the cost of the lockstep, not a speedup).
set -uo pipefail
cd /work/main
export PATH=/work/main/.venv/bin:$PATH
P="Write a Python function that checks whether a number is prime."
R=$(ls -d ~/.cache/dflash2/models/untrained-qwen2.5-coder-0.5b-test-*)
out=${OUT:-runs/distq}; mkdir -p $out
for rep in 1 2; do
for mode in none random; do
  d=(--drafter none); [ $mode = random ] && d=(--drafter $R --block-size 4)
  dflash2 run qwen2.5-coder-0.5b "$P" --max-tokens 48 "${d[@]}" --json > $out/r1-$mode-$rep.json 2>/dev/null
  mlx.launch -n 2 --backend ring -- dflash2 run qwen2.5-coder-0.5b "$P" --max-tokens 48 "${d[@]}" --json \
      > $out/r2-$mode-$rep.json 2>/dev/null
done
done
python3 - "$out" <<'PY'
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    t = open(f).read()
    try:
        d = json.loads(t[t.index('{'):])
    except Exception as e:
        print(f.split('/')[-1], 'no json', t[-200:]); continue
    print(f.split('/')[-1], d['n_tokens'], round(d['decode_tps'], 2), d['tau'], (d.get('distributed') or {}).get('size'), d['token_ids'][:6])
PY
