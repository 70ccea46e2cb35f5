"""Fused Metal kernel for DFlash 2's candidate selector: pair-score lattice + walk.

One launch per selector call computes the lattice [B, L, K, K] and walks it (greedy argmax,
or inverse-CDF sampling of pre-drawn uniforms, which also yields the q rows). The MLX-ops
twin (`drafter.selector.lattice_ops` + `greedy_walk_ops` / `sampled_walk_ops`) spreads the
same work over ~10 + 3L tiny launches, which is what dominates the selector on Apple GPUs.
Sources: metal/selector_lattice.metal (body) and metal/selector_walk.metal (header),
shipped as package data in dflash2_mlx/_metal.

Dispatch: the kernel runs when Metal is available and the default device is the GPU,
unless `use_kernel=False` or DFLASH2_NO_KERNELS=1. `routed(kernel)` sends launches to any
object with the call signature of `mx.fast.metal_kernel`'s result; the Linux tests route
them to a C++ emulation compiled from the same source text (tests/metal_emu).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx

from ..errors import KernelUnavailableError

NAME = "dflash2_selector"
BODY_FILE = "selector_lattice.metal"
HEADER_FILE = "selector_walk.metal"
INPUT_NAMES = ("candidates", "unary", "gate", "pred_codebook", "succ_codebook", "anchor", "uniforms",
               "temperature")
OUTPUT_NAMES = ("lattice", "path", "q")
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_K = 32  # one thread per lattice cell: K * K <= 1024 threads per threadgroup
ENV_DISABLE = "DFLASH2_NO_KERNELS"


# ----------------------------------------------------------------------------- sources

def metal_dir() -> Path | None:
    """Where the .metal sources are: the installed package data, else the repo's metal/."""
    packaged = resources.files("dflash2_mlx") / "_metal"
    if packaged.is_dir() and (packaged / BODY_FILE).is_file():
        return Path(str(packaged))
    repo = Path(__file__).resolve().parents[2] / "metal"
    return repo if (repo / BODY_FILE).is_file() else None


def metal_source(name: str) -> str:
    where = metal_dir()
    if where is None:
        raise KernelUnavailableError(f"Metal source {name} not found in dflash2_mlx/_metal or the repo's metal/")
    return (where / name).read_text()


def build(factory=None, source: str | None = None, header: str | None = None):
    """The selector kernel object made by `factory` (default `mx.fast.metal_kernel`)."""
    factory = factory or mx.fast.metal_kernel
    return factory(name=NAME, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                   source=metal_source(BODY_FILE) if source is None else source,
                   header=metal_source(HEADER_FILE) if header is None else header,
                   ensure_row_contiguous=True)


@functools.cache
def _metal_kernel():
    # Built once, and only where Metal exists.
    return build() if mx.metal.is_available() else None


# ----------------------------------------------------------------------------- dispatch

_routed = None


@contextmanager
def routed(kernel):
    """Send every selector launch to `kernel` (and count the kernel as available) inside."""
    global _routed
    previous, _routed = _routed, kernel
    try:
        yield kernel
    finally:
        _routed = previous


def disabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE) == "1"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if _routed is not None:
        return None
    if not mx.metal.is_available():
        return "no Metal GPU on this machine"
    if mx.default_device() != mx.gpu:
        return f"the default device is {mx.default_device()}, not the GPU"
    if metal_dir() is None:
        return "the .metal sources are missing from the installation"
    return None


def available() -> bool:
    return unavailable_reason() is None


def should_use(use_kernel: bool | None) -> bool:
    """Kernel or ops twin: None = kernel when available; False = ops; True = kernel or raise."""
    if use_kernel is False or disabled_by_env():
        return False
    reason = unavailable_reason()
    if use_kernel and reason is not None:
        raise KernelUnavailableError(f"the fused selector kernel was requested (use_kernel=True) but {reason}")
    return reason is None


def status() -> dict:
    """Which selector path is active and why (printed by `dflash2 doctor`)."""
    reason = unavailable_reason()
    if disabled_by_env():
        path, why = "ops", f"disabled by {ENV_DISABLE}=1"
    elif reason is not None:
        path, why = "ops", reason
    elif _routed is not None:
        path, why = "kernel", f"routed to {type(_routed).__name__}"
    else:
        path, why = "kernel", "Metal GPU: fused lattice + walk, one launch per call"
    where = metal_dir()
    return {"selector": path, "reason": why, "metal_available": bool(mx.metal.is_available()),
            "default_device": str(mx.default_device()), "env_disabled": disabled_by_env(),
            "sources": str(where) if where else None}


# ----------------------------------------------------------------------------- launch

@dataclass(frozen=True)
class Launch:
    """Everything one kernel call takes, so tests can hand the same launch to an emulator."""

    inputs: tuple
    template: tuple
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple
    output_dtypes: tuple

    def kwargs(self) -> dict:
        return dict(inputs=list(self.inputs), template=list(self.template), grid=self.grid,
                    threadgroup=self.threadgroup, output_shapes=list(self.output_shapes),
                    output_dtypes=list(self.output_dtypes))


def fits(candidates: mx.array, gate: mx.array, pred_codebook, succ_codebook) -> bool:
    """Whether the kernel handles these inputs (else the ops twin does)."""
    dense = all(isinstance(c, mx.array) and c.ndim == 2 for c in (pred_codebook, succ_codebook))
    return (dense and candidates.ndim == 3 and 1 <= candidates.shape[-1] <= MAX_K
            and all(x.dtype in FLOAT_DTYPES for x in (gate, pred_codebook, succ_codebook)))


def _check_shapes(candidates, unary, gate, pred_codebook, succ_codebook, anchor, uniforms, sampled) -> None:
    B, L, K = candidates.shape
    R = gate.shape[-1]
    expected = {"unary": (unary.shape, (B, L, K)), "gate": (gate.shape, (B, L, R)),
                "pred_codebook": (pred_codebook.shape[1:], (R,)), "succ_codebook": (succ_codebook.shape[1:], (R,)),
                "anchor": ((anchor.size,), (B,))}
    if sampled:
        expected["uniforms"] = (None if uniforms is None else uniforms.shape, (B, L))
    for name, (got, want) in expected.items():
        if got is None or tuple(got) != want:
            raise ValueError(f"selector kernel: {name} has shape {got}, expected {want} "
                             f"(candidates {tuple(candidates.shape)}, gate {tuple(gate.shape)})")
    if R < 1 or L < 1:
        raise ValueError(f"selector kernel: empty block or rank (L={L}, r={R})")


def plan(candidates, unary, gate, pred_codebook, succ_codebook, anchor, temperature: float,
         uniforms: mx.array | None = None) -> Launch:
    """The launch for one selector call. Greedy when temperature <= 0."""
    sampled = temperature > 0
    _check_shapes(candidates, unary, gate, pred_codebook, succ_codebook, anchor, uniforms, sampled)
    B, L, K = candidates.shape
    inputs = (candidates.astype(mx.int32), unary.astype(mx.float32), gate, pred_codebook, succ_codebook,
              anchor.reshape(B).astype(mx.int32),
              uniforms.astype(mx.float32) if sampled else mx.zeros((1,), mx.float32),
              mx.array([temperature if sampled else 1.0], dtype=mx.float32))
    template = (("GT", gate.dtype), ("AT", pred_codebook.dtype), ("BT", succ_codebook.dtype), ("K", K),
                ("SAMPLED", int(sampled)))
    return Launch(inputs=inputs, template=template, grid=(K * K, B, 1), threadgroup=(K * K, 1, 1),
                  output_shapes=((B, L, K, K), (B, L), (B, L, K) if sampled else (1,)),
                  output_dtypes=(mx.float32, mx.int32, mx.float32))


def launch(job: Launch, kernel=None) -> list[mx.array]:
    """Run `job` on `kernel`, else the routed kernel, else the Metal one. -> [lattice, path, q]"""
    kernel = kernel or _routed or _metal_kernel()
    if kernel is None:
        raise KernelUnavailableError(f"no selector kernel can run here: {unavailable_reason()}")
    return kernel(**job.kwargs())


def select_kernel(candidates, unary, gate, pred_codebook, succ_codebook, anchor, temperature: float,
                  uniforms: mx.array | None = None, kernel=None):
    """Same contract as the ops path of `drafter.selector.select`:
    (indices [B, L] int32, q [B, L, K] float32 or None when temperature <= 0). Inputs the kernel
    does not take (`fits`) are refused; `drafter.selector.select` sends those to the ops twin."""
    if not fits(candidates, gate, pred_codebook, succ_codebook):
        raise KernelUnavailableError(f"the selector kernel does not fit these inputs: {candidates.shape[-1]} "
                                     f"candidates (at most {MAX_K}), gate {gate.dtype}, dense float codebooks needed")
    job = plan(candidates, unary, gate, pred_codebook, succ_codebook, anchor, temperature, uniforms)
    _, path, q = launch(job, kernel)
    return path, (q if temperature > 0 else None)


def lattice_kernel(candidates, unary, gate, pred_codebook, succ_codebook, anchor, kernel=None) -> mx.array:
    """The kernel's lattice [B, L, K, K] (twin of `lattice_ops`)."""
    return launch(plan(candidates, unary, gate, pred_codebook, succ_codebook, anchor, 0.0), kernel)[0]
