"""DFlash 2's two-tap grouped dynamic causal convolution (dflash-algorithm.md §2.3).

Around each sublayer of a draft layer:

    h   = RMSNorm(x)
    dyn = kernel_projection(h) -> [.., L, 2, K, H/G]     (one coefficient per tap per group)
    u   = conv(h, dyn[0], base[0]);  y = sublayer(u);  y = conv(y, dyn[1], base[1])
    conv(v)_t = sum_o (base[o] + dyn[t, o] broadcast over the G channels of a group) * v_{t-o}

`v_{t-o}` is zero before block position 0, so the convolution never crosses a block
boundary: the conv axis is -2 and callers put one block there (training reshapes to
[B, n_blocks, block, H]). At identity init (base tap 0 = 1, others 0, projection 0) the
layer is exactly the DFlash v1 layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _shift(x: mx.array, o: int) -> mx.array:
    """x delayed by `o` steps along axis -2, zero-filled."""
    if o == 0:
        return x
    L = x.shape[-2]
    if o >= L:
        return mx.zeros_like(x)
    pad = mx.zeros((*x.shape[:-2], o, x.shape[-1]), dtype=x.dtype)
    return mx.concatenate([pad, x[..., : L - o, :]], axis=-2)


def grouped_dynamic_conv(x: mx.array, dyn: mx.array, base: mx.array, group_size: int) -> mx.array:
    """Apply one grouped dynamic causal convolution (computed in fp32, returned in x's dtype).

    Shapes:
        x:    [..., L, H]
        dyn:  [..., L, K, H / group_size]
        base: [K, H]
        out:  [..., L, H]
    """
    *lead, L, H = x.shape
    n_groups = H // group_size
    # Accumulate in fp32 and round once: in bf16, base + dyn rounds the small dynamic term away.
    x32, dyn32 = x.astype(mx.float32), dyn.astype(mx.float32)
    out = None
    for o in range(base.shape[0]):
        v = _shift(x32, o).reshape(*lead, L, n_groups, group_size)
        term = base[o].astype(mx.float32).reshape(n_groups, group_size) * v + dyn32[..., o, :, None] * v
        out = term if out is None else out + term
    return out.reshape(x.shape).astype(x.dtype)


class GroupedDynamicCausalConv(nn.Module):
    """`prepare` convolves a sublayer's input, `finish` its output, both with
    coefficients computed once from the normalised input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        n_groups = hidden_size // group_size
        base = mx.zeros((2, kernel_size, hidden_size))
        base[:, 0, :] = 1.0
        self.base_kernel = base
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * n_groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def prepare(self, h: mx.array) -> tuple[mx.array, mx.array]:
        n_groups = h.shape[-1] // self.group_size
        dyn = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.kernel_size, n_groups)
        return grouped_dynamic_conv(h, dyn[..., 0, :, :], self.base_kernel[0], self.group_size), dyn[..., 1, :, :]

    def finish(self, y: mx.array, dyn_post: mx.array) -> mx.array:
        return grouped_dynamic_conv(y, dyn_post, self.base_kernel[1], self.group_size)
