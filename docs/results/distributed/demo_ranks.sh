#!/usr/bin/env bash
# Issue 25's table on this 2-core machine: the demo pair (SmolLM2-135M, 9 heads / 3 K/V heads:
# it shards over 1 or 3 ranks, not 2) plain and DFlash 2 at width 4, 1 rank vs 3 ring ranks on
# loopback; then the collectives of one verify pass alone (collectives.py) at 2 and 3 ranks for
# the demo target's and Qwen2.5-Coder-0.5B's shapes. 3 ranks on 2 cores are oversubscribed: the
# table measures the lockstep's cost here, not a multi-Mac speedup.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export PATH=$PWD/.venv/bin:$PATH
P="Why is the sky blue? Answer in two sentences."
out=${OUT:-runs/dist-demo}; mkdir -p "$out"
for rep in 1 2; do
  for mode in none dflash2; do
    d=(--drafter none); [ $mode = dflash2 ] && d=(--block-size 4)
    dflash2 run "$P" --max-tokens 48 "${d[@]}" --json > "$out/r1-$mode-$rep.json" 2>/dev/null
    timeout 900 mlx.launch -n 3 --backend ring -- dflash2 run "$P" --max-tokens 48 "${d[@]}" --json \
        > "$out/r3-$mode-$rep.json" 2>/dev/null
  done
done
python3 - "$out" <<'PY'
import glob, json, sys
print("# file, tokens, decode tok/s, tau, ranks, mode, first token ids")
for f in sorted(glob.glob(sys.argv[1] + "/r*.json")):
    t = open(f).read()
    try:
        d = json.loads(t[t.index("{"):])
    except ValueError:
        print(f.split("/")[-1], "no json", t[-200:]); continue
    dist = d.get("distributed") or {}
    print(f.split("/")[-1], d["n_tokens"], round(d["decode_tps"], 2), round(d["tau"], 2), dist.get("size") or 1,
          dist.get("mode"), d["token_ids"][:6])
PY
echo "# collectives of one verify pass alone (ms per cycle), LAYERS HIDDEN DTYPE"
for n in 2 3; do
  timeout 300 mlx.launch -n $n --backend ring -- python docs/results/distributed/collectives.py 30 576 float32
  timeout 300 mlx.launch -n $n --backend ring -- python docs/results/distributed/collectives.py 24 896 bfloat16
done
