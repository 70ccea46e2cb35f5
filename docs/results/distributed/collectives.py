"""The collectives of one sharded verify pass, timed alone: a tensor-parallel decoder layer sums
its attention and MLP outputs over the ranks (two all-reduces of rows x hidden), and the lockstep
adds one small int array per cycle. Run under `mlx.launch -n N --backend ring -- python
collectives.py LAYERS HIDDEN DTYPE`; rank 0 prints one JSON line per width (ms per cycle).

Compute is left out on purpose: this is the latency floor the collectives add to each cycle,
which a verify pass pays once whatever its width (rows) is."""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx

WIDTHS = (1, 2, 4, 8)
REPS = 20


def one_cycle(x: mx.array, layers: int, group) -> mx.array:
    """2 all-reduces per layer on the hidden rows, then the lockstep's int array."""
    for _ in range(2 * layers):
        x = mx.distributed.all_sum(x, group=group) * (1.0 / group.size())
    control = mx.distributed.all_sum(mx.zeros((x.shape[1] + 2,), mx.int32), group=group)
    return x.sum() + control.sum().astype(x.dtype)


def time_width(width: int, layers: int, hidden: int, dtype, group) -> float:
    x = mx.ones((1, width, hidden), dtype=dtype)
    mx.eval(one_cycle(x, layers, group))  # warm-up: the ring's connections and buffers
    start = time.perf_counter()
    for _ in range(REPS):
        mx.eval(one_cycle(x, layers, group))
    return (time.perf_counter() - start) / REPS * 1e3


def main() -> None:
    layers, hidden, dtype_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = mx.distributed.init()
    dtype = getattr(mx, dtype_name)
    for width in WIDTHS:
        ms = time_width(width, layers, hidden, dtype, group)
        if group.rank() == 0:
            print(json.dumps({"ranks": group.size(), "layers": layers, "hidden": hidden, "dtype": dtype_name,
                              "width": width, "all_reduces": 2 * layers + 1, "ms_per_cycle": round(ms, 3),
                              "us_per_all_reduce": round(ms * 1e3 / (2 * layers + 1), 1)}), flush=True)


if __name__ == "__main__":
    main()
