"""Micro-benchmark of one candidate-selector call: MLX-ops twin vs the fused Metal kernel.

    python -m dflash2_mlx.kernels.bench [--json OUT] [--iters N] [--lengths 4,8,16]

A call is what `CandidateSelector` does after the LM head: top-k over the vocabulary
(shared by both paths) then lattice + walk (ops: ~10 + 3L launches; kernel: one). Rows
cover L = 4, 8, 16 drafts and V = 49k, 152k, 248k (SmolLM2, Qwen3, Qwen3.5 vocabularies)
at r = 256, greedy and sampled. Times are medians of wall time per call, evaluated.
Without Metal the kernel column reads n/a: the kernel cannot run, and its C++ emulation
(tests/metal_emu) proves correctness only, never speed.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

LENGTHS = (4, 8, 16)
VOCABS = (49152, 151936, 248320)
TOP_K = 16
RANK = 256


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def codebooks(V: int, dtype, seed: int = 0):
    """Random A, B [V, r], scaled like a trained selector (pair terms ~ unary logits)."""
    import mlx.core as mx

    ka, kb = mx.random.split(mx.random.key(seed))
    pair = ((mx.random.normal((V, RANK), key=ka) * 0.25).astype(dtype),
            (mx.random.normal((V, RANK), key=kb) * 0.25).astype(dtype))
    mx.eval(pair)
    return pair


def measure(V: int, L: int, temperature: float, iters: int, books, kernel_ok: bool, warmup: int = 3) -> dict:
    """One table row: top-k, ops lattice+walk, kernel lattice+walk and whole calls (ms)."""
    import mlx.core as mx

    from ..drafter.selector import select, topk_candidates
    from . import selector as ksel

    dtype = books[0].dtype
    k_logits, k_gate, k_u = mx.random.split(mx.random.key(L), 3)
    logits = (mx.random.normal((1, L, V), key=k_logits) * 4).astype(dtype)
    gate = mx.random.normal((1, L, RANK), key=k_gate).astype(dtype)
    uniforms = mx.random.uniform(shape=(1, L), key=k_u)
    anchor = mx.array([7], dtype=mx.int32)
    cands, unary = topk_candidates(logits, TOP_K)
    mx.eval(logits, gate, uniforms, cands, unary)
    args = (cands, unary, gate, *books, anchor, temperature, uniforms)

    def call(use_kernel):
        c, u = topk_candidates(logits, TOP_K)
        return select(c, u, gate, *books, anchor, temperature, uniforms, use_kernel)

    def timed(fn):
        return _median_ms(fn, iters, warmup)

    row = {"L": L, "V": V, "walk": "sampled" if temperature > 0 else "greedy",
           "topk_ms": timed(lambda: topk_candidates(logits, TOP_K)),
           "ops_ms": timed(lambda: select(*args, use_kernel=False)),
           "call_ops_ms": timed(lambda: call(False)),
           "kernel_ms": None, "call_kernel_ms": None, "speedup": None}
    if kernel_ok:
        row["kernel_ms"] = timed(lambda: ksel.select_kernel(*args))
        row["call_kernel_ms"] = timed(lambda: call(True))
        row["speedup"] = row["call_ops_ms"] / row["call_kernel_ms"]
    return row


def _table(rows: list[dict], title: str, note: str, with_kernel: bool):
    from rich.table import Table

    columns = ["L", "V", "walk", "top-k", "ops", "kernel", "call ops", "call kernel"]
    table = Table(title=title, caption=note)
    for name in columns + (["speedup"] if with_kernel else []):
        table.add_column(name, justify="left" if name == "walk" else "right", no_wrap=True)

    def ms(v):
        return "n/a" if v is None else f"{v:.3f}"

    for r in rows:
        cells = [str(r["L"]), f"{r['V'] / 1000:.0f}k", r["walk"], ms(r["topk_ms"]), ms(r["ops_ms"]),
                 ms(r["kernel_ms"]), ms(r["call_ops_ms"]), ms(r["call_kernel_ms"])]
        table.add_row(*cells, *([f"{r['speedup']:.2f}x"] if with_kernel else []))
    return table


def run(lengths=LENGTHS, vocabs=VOCABS, iters: int = 30, dtype_name: str = "bfloat16", warmup: int = 3,
        progress: bool = True) -> dict:
    """Measure every (V, L, walk) row; returns the JSON-ready report."""
    import mlx.core as mx
    from rich.progress import Progress

    from . import selector as ksel

    dtype = getattr(mx, dtype_name)
    device = "gpu" if mx.metal.is_available() else "cpu"
    previous = mx.default_device()
    mx.set_default_device(getattr(mx, device))
    try:
        kernel_ok = ksel.available() and not ksel.disabled_by_env()
        rows = []
        with Progress(transient=True, disable=not progress) as bar:
            task = bar.add_task("selector calls", total=len(vocabs) * len(lengths) * 2)
            for V in vocabs:
                books = codebooks(V, dtype)
                for L in lengths:
                    for temperature in (0.0, 1.0):
                        rows.append(measure(V, L, temperature, iters, books, kernel_ok, warmup))
                        bar.advance(task)
                del books
    finally:
        mx.set_default_device(previous)
    if kernel_ok:
        note = "ops = MLX-ops twin, kernel = fused Metal kernel (one launch)"
    else:
        note = (f"kernel n/a: {ksel.status()['reason']}. Only the ops path is measured here; the kernel's "
                "C++ emulation checks correctness, not speed.")
    return {"device": device, "platform": platform.platform(), "mlx": mx.__version__, "dtype": dtype_name,
            "rank": RANK, "top_k": TOP_K, "iters": iters, "kernel_available": kernel_ok,
            "selector_status": ksel.status(), "note": note, "rows": rows}


def main(
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here.")] = None,
    iters: Annotated[int, typer.Option("--iters", min=1, help="Timed calls per row (median reported).")] = 30,
    lengths: Annotated[str, typer.Option("--lengths", help="Draft lengths L, comma-separated.")] = "4,8,16",
    vocabs: Annotated[str, typer.Option("--vocabs", help="Vocabulary sizes V, comma-separated.")]
    = ",".join(map(str, VOCABS)),
    dtype: Annotated[str, typer.Option("--dtype", help="Gate and codebook dtype: bfloat16, float16, float32.")]
    = "bfloat16",
) -> None:
    """Time one selector call, ops twin vs fused Metal kernel, and print a table.

    Examples:

      python -m dflash2_mlx.kernels.bench --json selector-bench.json

      python -m dflash2_mlx.kernels.bench --lengths 8 --vocabs 151936 --iters 100
    """
    from rich.console import Console

    if dtype not in ("bfloat16", "float16", "float32"):
        raise typer.BadParameter(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}")
    report = run(_ints(lengths), _ints(vocabs), iters, dtype)
    title = (f"Selector call in ms (median of {iters}): r={RANK}, top-{TOP_K}, {dtype}, {report['device']}; "
             "ops/kernel = lattice + walk, call = top-k + lattice + walk")
    Console().print(_table(report["rows"], title, report["note"], report["kernel_available"]))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        Console(stderr=True).print(f"wrote {json_out}")


if __name__ == "__main__":
    typer.run(main)
