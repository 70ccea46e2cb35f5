"""Time `Target.commit` with the per-layer vs the stacked GatedDeltaNet replay.

A random qwen3_5 model, tiny but as deep as Qwen3.x-27B's recurrent stack (64 layers, every
fourth full attention: 48 GatedDeltaNet layers), is prefilled; then each trial arms the
caches, runs one verify pass of `--width` tokens, and times `commit(keep)` including the
evaluation of the rebuilt states. The two modes are two Targets over the same model and
alternate trial by trial, so drift on a shared machine hits both alike.

    .venv/bin/python docs/results/stacked-replay/measure_commit.py            # CPU
    .venv/bin/python docs/results/stacked-replay/measure_commit.py --gpu      # Metal / GPU

Prints a table and writes JSON (`--out`); the last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from dflash2_mlx.core.caches import RecurrentCache
from dflash2_mlx.target import Target

HERE = Path(__file__).parent


def build_model(layers: int, interval: int, hidden: int, dtype):
    from mlx_lm.models import qwen3_5

    text = dict(model_type="qwen3_5_text", vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=hidden // 8,
                linear_value_head_dim=hidden // 8, linear_conv_kernel_dim=4, full_attention_interval=interval,
                rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(dict(model_type="qwen3_5", text_config=text)))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _recurrent(cache):
    return [a for c in cache if isinstance(c, RecurrentCache) for a in c.cache]


def time_commit(target: Target, cache: list, width: int, keep: int, step: int) -> tuple[float, float]:
    """(seconds to build the commit graph, seconds including its evaluation) for one commit(keep)."""
    block = mx.array([[(7 * step + 3 * j) % 90 + 3 for j in range(width)]])
    target.arm(cache)
    logits, _ = target.forward(block, cache)
    mx.eval(logits, [c.state for c in cache])
    t0 = time.perf_counter()
    target.commit(cache, n_fed=width, n_keep=keep)
    t1 = time.perf_counter()
    mx.eval(_recurrent(cache))
    return t1 - t0, time.perf_counter() - t0


def measure(args) -> dict:
    dtype = getattr(mx, args.dtype)
    model = build_model(args.layers, args.interval, args.hidden, dtype)
    modes = {"per_layer": Target(model, None, stacked_replay=False), "stacked": Target(model, None)}
    n_gdn = len(modes["stacked"].info.recurrent_layers)
    prompt = mx.array([[(5 * i) % 90 + 3 for i in range(args.prompt)]])
    rows = []
    for keep in args.keeps:
        caches = {}
        for name, target in modes.items():
            caches[name] = target.make_cache(reserve=args.width)
            target.forward(prompt, caches[name], logits="none")
            mx.eval([c.state for c in caches[name]])
        times = {name: [] for name in modes}
        for step in range(args.warmup + args.runs):
            for name, target in modes.items():
                t = time_commit(target, caches[name], args.width, keep, step)
                if step >= args.warmup:
                    times[name].append(t)
        row = dict(keep=keep)
        for name, ts in times.items():
            row[f"{name}_ms"] = statistics.median(t for _, t in ts) * 1e3
            row[f"{name}_build_ms"] = statistics.median(b for b, _ in ts) * 1e3
            row[f"{name}_all_ms"] = [t * 1e3 for _, t in ts]
        row["speedup"] = row["per_layer_ms"] / row["stacked_ms"]
        rows.append(row)
    return dict(device=str(mx.default_device()), machine=platform.machine(), processor=platform.processor(),
                mlx=mx.__version__, layers=args.layers, gdn_layers=n_gdn, hidden=args.hidden, dtype=args.dtype,
                width=args.width, prompt=args.prompt, runs=args.runs, warmup=args.warmup, rows=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--interval", type=int, default=4, help="every INTERVAL-th layer is full attention")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--width", type=int, default=8, help="verify width (tokens per verify pass)")
    p.add_argument("--keeps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 7])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gpu", action="store_true", help="run on the GPU (default: CPU)")
    p.add_argument("--out", type=Path, default=HERE / "commit_timing_cpu.json")
    args = p.parse_args()
    mx.set_default_device(mx.gpu if args.gpu else mx.cpu)
    result = measure(args)
    print(f"Target.commit, {result['gdn_layers']} GatedDeltaNet of {result['layers']} layers, hidden {args.hidden}, "
          f"{args.dtype}, width {args.width}, {result['device']}; median of {args.runs} ms")
    print(f"{'keep':>5} {'per-layer':>10} {'stacked':>10} {'speedup':>8}   graph build: {'per-layer':>9} {'stacked':>8}")
    for r in result["rows"]:
        print(f"{r['keep']:>5} {r['per_layer_ms']:>10.3f} {r['stacked_ms']:>10.3f} {r['speedup']:>7.2f}x"
              f"   {'':>12} {r['per_layer_build_ms']:>9.3f} {r['stacked_build_ms']:>8.3f}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {"rows": [{k: v for k, v in r.items() if not k.endswith("all_ms")} for r in result["rows"]]}))


if __name__ == "__main__":
    main()
