"""Attention over quantized K/V through `FloatReadView` equals mlx-lm's own quantized attention
(its slow twin) up to float rounding, leaves the cache stored exactly as mlx-lm stores it, and
is used where `float_reads` says."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from dflash2_mlx.core.kv_attention import LONG_PASS, FloatReadView, attention_view, float_reads, unpack_groups

from tiny import tiny_target

PROMPT = [1, 5, 9, 14, 3, 22, 7, 31, 40, 12, 18, 6, 27, 33, 8, 11]


def _quantized(target, bits: int, group: int) -> list:
    return [QuantizedKVCache(group, bits) if type(c) is KVCache else c for c in target.base_cache()]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_float_reads_give_mlx_lm_quantized_attention_and_store_the_same_cache(family, bits, group):
    target = tiny_target(family, head_dim=64)
    viewed, reference = _quantized(target, bits, group), _quantized(target, bits, group)
    # a prompt, then one-token steps: both the multi-token and the single-token paths
    chunks = [PROMPT[:10], PROMPT[10:], [4], [19], [2]]
    for chunk in chunks:
        tokens = mx.array([chunk])
        # the view itself, not `attention_view`: on a GPU a one-token step would not be viewed
        fast = target.model(tokens, cache=[FloatReadView(c) if type(c) is QuantizedKVCache else c
                                           for c in viewed])
        slow = target.model(tokens, cache=reference)
        mx.eval(fast, slow)
        # rounding differs in the order of sums, and can move a later layer's value by one quantization step
        assert mx.allclose(fast, slow, atol=3e-3, rtol=1e-3).item(), mx.abs(fast - slow).max().item()
        assert mx.argmax(fast[0, -1]).item() == mx.argmax(slow[0, -1]).item()
    for a, b in zip(viewed, reference):
        assert a.offset == b.offset == len(PROMPT) + 3
        assert type(a) is QuantizedKVCache and (a.bits, a.group_size) == (bits, group)
        for stored_a, stored_b in ((a.keys, b.keys), (a.values, b.values)):
            n = a.offset
            a_, b_ = (mx.dequantize(*(p[..., :n, :] for p in s), group_size=group, bits=bits)
                      for s in (stored_a, stored_b))
            step = mx.max(stored_b[1][..., :n, :]).item()  # the largest group's scale: one step
            assert mx.abs(a_ - b_).max().item() <= step * 1.01


def test_the_view_hides_bits_so_mlx_lm_takes_its_float_kernel():
    cache = QuantizedKVCache(64, 8)
    view = FloatReadView(cache)
    assert not hasattr(view, "bits") and hasattr(cache, "bits")
    keys = mx.random.normal((1, 2, 5, 64), key=mx.random.key(0))
    out_keys, out_values = view.update_and_fetch(keys, keys * 2)
    assert out_keys.dtype == keys.dtype and out_keys.shape == keys.shape and view.offset == cache.offset == 5
    assert mx.allclose(out_keys, keys, atol=0.05).item()  # 8-bit groups of 64: ~1/255 of each group's range


def test_float_reads_always_on_the_cpu_and_for_long_passes_elsewhere():
    cpu, gpu = mx.Device(mx.cpu), mx.Device(mx.gpu)
    assert float_reads(1, cpu) and float_reads(LONG_PASS, cpu)
    assert not float_reads(1, gpu) and not float_reads(LONG_PASS - 1, gpu)
    assert float_reads(LONG_PASS, gpu)
    cache = [QuantizedKVCache(64, 8), KVCache()]
    viewed = attention_view(cache, LONG_PASS)  # viewed on every device
    assert isinstance(viewed[0], FloatReadView) and viewed[0].cache is cache[0] and viewed[1] is cache[1]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits, group", [(8, 64), (8, 32), (4, 64), (4, 32), (2, 64)])
def test_unpacked_groups_equal_mx_dequantize_bit_for_bit(dtype, bits, group):
    values = (mx.random.normal((1, 2, 37, 128), key=mx.random.key(bits * group)) * 3).astype(dtype)
    stored = mx.quantize(values, group_size=group, bits=bits)
    fast = unpack_groups(*stored, group_size=group, bits=bits)
    slow = mx.dequantize(*stored, group_size=group, bits=bits)
    assert fast.dtype == slow.dtype == dtype and fast.shape == slow.shape == values.shape
    assert mx.array_equal(fast, slow).item()
