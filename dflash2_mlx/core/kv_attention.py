"""How attention reads quantized K/V: at float speed, from the quantized store.

mlx-lm attends to a `QuantizedKVCache` with `quantized_matmul` over its stored groups and
materializes the scores itself. On MLX's CPU backend that is 3.5–4.4× slower than float
attention (one Qwen2.5-0.5B layer: a 2,048-token chunk over 16k keys, 33.0 s against 7.4 s;
a one-token step, 28 against 8 ms), so an 8-bit prefill took far longer than a full-precision
one. `FloatReadView` leaves the cache quantized and hands the layer its dequantized keys and
values, so the layer takes the float attention kernel over the same values, one layer's float
copy alive at a time. On the CPU the copy is unpacked from byte views (`unpack_groups`), bit for
bit what `mx.dequantize` gives in a third of its time there (16k keys of one layer: 1.3 ms
against 4.0 at 8-bit), since a decode step re-reads the whole cache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

# A GPU reads 8-bit K/V inside quantized_matmul; for a short pass that beats writing a float copy
# of the whole cache first. Not measured on Metal (it cannot run here): long passes only there.
LONG_PASS = 64


class FloatReadView:
    """A `QuantizedKVCache` as one layer sees it: an update is stored quantized, the read that
    follows is dequantized.

    It has no `bits` attribute on purpose: mlx-lm's `scaled_dot_product_attention` chooses its
    quantized path by `hasattr(cache, "bits")`.
    """

    __slots__ = ("cache",)

    def __init__(self, cache: QuantizedKVCache):
        self.cache = cache

    @property
    def offset(self) -> int:
        return self.cache.offset

    @property
    def keys(self):
        return self.cache.keys

    @keys.setter
    def keys(self, value) -> None:
        self.cache.keys = value

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        stored_keys, stored_values = self.cache.update_and_fetch(keys, values)
        group, bits = self.cache.group_size, self.cache.bits
        return float_copy(stored_keys, group, bits), float_copy(stored_values, group, bits)

    def make_mask(self, *args, **kwargs):
        return self.cache.make_mask(*args, **kwargs)


def unpack_groups(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize(packed, scales, biases, group_size, bits)` for 4- and 8-bit affine groups,
    read through a byte view of `packed` (its slow twin for other widths)."""
    if bits not in (4, 8):
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    codes = packed.view(mx.uint8)
    if bits == 4:  # the low nibble holds the earlier element (MLX packs from the low bits up)
        codes = mx.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    lead = codes.shape[:-1]
    groups = codes.astype(scales.dtype).reshape(*lead, -1, group_size)
    return (groups * scales[..., None] + biases[..., None]).reshape(*lead, -1)


def float_copy(stored: tuple, group_size: int, bits: int) -> mx.array:
    """The float values of stored (data, scales, biases) groups: unpacked from byte views on the
    CPU, `mx.dequantize` elsewhere."""
    read = unpack_groups if mx.default_device().type == mx.DeviceType.cpu else mx.dequantize
    return read(*stored, group_size=group_size, bits=bits)


def float_reads(n_tokens: int, device: mx.Device | None = None) -> bool:
    """Whether a pass of `n_tokens` reads quantized K/V through `FloatReadView` on `device`
    (default: MLX's default device): always on the CPU, from `LONG_PASS` tokens elsewhere."""
    device = device or mx.default_device()
    return device.type == mx.DeviceType.cpu or n_tokens >= LONG_PASS


def attention_view(cache: list, n_tokens: int) -> list:
    """`cache` as the model should see it for a pass of `n_tokens`: each `QuantizedKVCache`
    behind a `FloatReadView` where `float_reads` says so, every other layer's cache as it is."""
    if not float_reads(n_tokens):
        return cache
    return [FloatReadView(c) if type(c) is QuantizedKVCache else c for c in cache]
