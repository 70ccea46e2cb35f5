"""Per-layer cost of reading 8-bit K/V in one decode step, against float K/V (issue 26).

One layer of Qwen2.5-0.5B's shapes (14 query heads, 2 K/V heads, head dimension 64, float32 as the
offline copy runs): one query over `--keys` keys, best of 3 rounds of 20 steps each, and each way's
output against the float path's. Prints a table and writes JSON:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python \\
        docs/results/long-context/attention_read.py --keys 16384 --json attention-read.json
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from dflash2_mlx.core.kv_attention import unpack_groups

HEADS, KV_HEADS, HEAD_DIM, GROUP, BITS = 14, 2, 64, 64, 8


def best_ms(step, rounds: int = 3, steps: int = 20) -> float:
    mx.eval(step())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            mx.eval(step())
        best = min(best, (time.perf_counter() - start) / steps)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=16384, help="context length the step attends over")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    keys = mx.random.normal((1, KV_HEADS, args.keys, HEAD_DIM), key=mx.random.key(0))
    values = mx.random.normal((1, KV_HEADS, args.keys, HEAD_DIM), key=mx.random.key(1))
    query = mx.random.normal((1, HEADS, 1, HEAD_DIM), key=mx.random.key(2))
    stored_keys = mx.quantize(keys, group_size=GROUP, bits=BITS)
    stored_values = mx.quantize(values, group_size=GROUP, bits=BITS)
    mx.eval(stored_keys, stored_values)
    scale = HEAD_DIM ** -0.5

    def attend(k, v):
        return mx.fast.scaled_dot_product_attention(query, k, v, scale=scale)

    def read(unpack):
        return lambda: attend(unpack(*stored_keys, group_size=GROUP, bits=BITS),
                              unpack(*stored_values, group_size=GROUP, bits=BITS))

    ways = {
        "float K/V": lambda: attend(keys, values),
        # a copy: mlx-lm scales its queries in place (`queries *= scale`)
        "8-bit, mlx-lm quantized attention": lambda: quantized_scaled_dot_product_attention(
            mx.array(query), stored_keys, stored_values, scale=scale, mask=None, group_size=GROUP, bits=BITS),
        "8-bit, mx.dequantize + float kernel": read(mx.dequantize),
        "8-bit, unpack_groups + float kernel (ours)": read(unpack_groups),
    }
    dequantized = read(mx.dequantize)()
    rows = []
    for name, step in ways.items():
        ms = best_ms(step)
        error = mx.abs(step() - dequantized).max().item()
        rows.append({"way": name, "keys": args.keys, "ms_per_step": round(ms, 2), "max_abs_vs_dequantized": error})
    float_ms = rows[0]["ms_per_step"]
    print(f"one decode step of one layer over {args.keys} keys ({mx.default_device()})")
    print("| way | ms per step | × float | max abs. difference from dequantized |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['way']} | {row['ms_per_step']:.2f} | {row['ms_per_step'] / float_ms:.2f} "
              f"| {row['max_abs_vs_dequantized']:.2g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
