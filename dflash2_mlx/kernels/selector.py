"""Dispatch for the fused selector kernel (pair lattice + walk).

The kernel runs only on a Metal GPU, with dense codebooks, and unless disabled by
`use_kernel=False` or `DFLASH2_NO_KERNELS=1`; otherwise `drafter.selector` uses its
MLX-ops twin. No kernel is registered yet, so every call takes the ops path.
"""

from __future__ import annotations

import os

import mlx.core as mx

_KERNEL = None


def available() -> bool:
    return _KERNEL is not None and mx.metal.is_available() and mx.default_device() == mx.gpu


def should_use(use_kernel: bool | None) -> bool:
    if use_kernel is False or os.environ.get("DFLASH2_NO_KERNELS") == "1":
        return False
    return available()


def select_kernel(*args, **kwargs):
    raise RuntimeError("the fused selector kernel is not available on this device")
