"""Target adapter: taps, head, embedding scale, and exact rollback for every cache kind."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache, KVCache, RotatingKVCache

from dflash2_mlx.core.caches import RecurrentCache, WindowKVCache, adapt_cache
from dflash2_mlx.errors import ConfigError, UnsupportedCacheError
from dflash2_mlx.target import HiddenTap, Target

from tiny import FAMILIES, TinyTokenizer, tiny_model, tiny_target

rng = np.random.default_rng(2)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 90, size=n).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_matches_model_and_taps_match_layer_outputs(family):
    target = tiny_target(family)
    tokens = mx.array([_ids(7)])
    ref = target.model(tokens, cache=target.make_cache())
    logits, hidden = target.forward(tokens, target.make_cache(), taps=(0, 2, 3))
    np.testing.assert_allclose(np.array(logits), np.array(ref), rtol=1e-5, atol=1e-5)
    # Recompute layer outputs by hand from the embedding.
    h = target.embed(tokens)
    cache = target.make_cache()
    outs = []
    for i, layer in enumerate(target.inner.layers):
        mask = _mask_for(target, family, h, cache, i)
        h = layer(h, mask, cache[i])
        outs.append(h)
    expected = mx.concatenate([outs[0], outs[2], outs[3]], axis=-1)
    np.testing.assert_allclose(np.array(hidden), np.array(expected), rtol=1e-5, atol=1e-5)


def _mask_for(target, family, h, cache, i):
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    if family == "qwen3_5":
        layer = target.inner.layers[i]
        return create_ssm_mask(h, cache[i]) if layer.is_linear else create_attention_mask(h, cache[i])
    if family == "gemma3_text":
        window = FAMILIES[family]["sliding_window"] if i % 2 == 0 else None
        return create_attention_mask(h, cache[i], window_size=window)
    return create_attention_mask(h, cache[i])


def test_embedding_scale_is_measured():
    assert tiny_target("gemma3_text").info.embed_scale == pytest.approx(8.0)
    assert tiny_target("llama").info.embed_scale == 1.0


@pytest.mark.parametrize("hidden", [72, 1152])
def test_embedding_scale_is_measured_in_bf16_when_sqrt_hidden_is_inexact(hidden):
    # Gemma scales by bf16(sqrt(H)) and rounds the product to bf16; the probe must allow that.
    model = tiny_model("gemma3_text", hidden_size=hidden)
    model.set_dtype(mx.bfloat16)
    target = Target(model, TinyTokenizer.make())
    scale = mx.array(hidden**0.5, mx.bfloat16)
    assert target.info.embed_scale == pytest.approx(scale.item())
    tokens = mx.array([_ids(5)])
    expected = target.inner.embed_tokens(tokens) * scale.astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(target.embed(tokens).astype(mx.float32)),
                                  np.array(expected.astype(mx.float32)))


def test_load_target_dtype_keeps_what_the_family_keeps_in_fp32(tmp_path):
    from mlx.utils import tree_flatten

    from dflash2_mlx.target import load_target

    from tiny import save_tiny_pair

    target_dir, _ = save_tiny_pair(tmp_path, family="qwen3_5")
    target = load_target(target_dir, dtype="bfloat16")
    dtypes = {k: v.dtype for k, v in tree_flatten(target.model.parameters())}
    kept = {k for k in dtypes if k.endswith("A_log")}  # qwen3_5's cast_predicate excludes A_log
    assert kept and all(dtypes[k] == mx.float32 for k in kept)
    assert all(d == mx.bfloat16 for k, d in dtypes.items() if k not in kept)


def test_tied_and_untied_heads():
    tied = tiny_target("gemma3_text")
    assert "lm_head" not in tied.model
    h = mx.array(rng.normal(size=(1, 2, 64)), dtype=mx.float32)
    np.testing.assert_allclose(np.array(tied.head(h)), np.array(h @ tied.inner.embed_tokens.weight.T), rtol=1e-5)
    untied = tiny_target("qwen3_5")  # head under language_model
    np.testing.assert_allclose(np.array(untied.head(h)),
                               np.array(h @ untied.model.language_model.lm_head.weight.T), rtol=1e-5)


def _rollback_case(target, prefix, block, keep, reserve=16):
    """Logits of the next token after prefix+block[:keep], via rollback vs a fresh cache."""
    cache = target.make_cache(reserve=reserve)
    target.forward(mx.array([prefix]), cache)
    target.arm(cache)
    target.forward(mx.array([block]), cache)
    target.commit(cache, n_fed=len(block), n_keep=keep)
    probe = [11, 12]
    rolled, _ = target.forward(mx.array([probe]), cache)
    fresh = target.make_cache(reserve=reserve)
    target.forward(mx.array([prefix + block[:keep]]), fresh)
    expect, _ = target.forward(mx.array([probe]), fresh)
    return np.array(rolled), np.array(expect)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("keep", [1, 3, 6])
def test_rollback_is_exact(family, keep):
    target = tiny_target(family)
    prefix = _ids(21, seed=keep)  # > window 8, so the gemma ring has wrapped
    rolled, expect = _rollback_case(target, prefix, _ids(6, seed=50 + keep), keep)
    np.testing.assert_allclose(rolled, expect, rtol=1e-4, atol=1e-4)


def test_gated_delta_fast_replay_equals_generic_replay():
    fast, generic = tiny_target("qwen3_5"), tiny_target("qwen3_5", fast_recurrent_replay=False)
    assert type(fast.inner.layers[0].inner.linear_attn).__name__ == "GatedDeltaReplay"
    assert type(generic.inner.layers[0].inner.linear_attn).__name__ == "MixerReplay"
    for keep in (1, 2, 5):
        caches = []
        for target in (fast, generic):
            cache = target.make_cache()
            target.forward(mx.array([_ids(9)]), cache)
            target.arm(cache)
            target.forward(mx.array([_ids(5, seed=3)]), cache)
            target.commit(cache, 5, keep)
            caches.append(cache)
        for c_fast, c_gen in zip(*caches):
            if isinstance(c_fast, RecurrentCache):
                for a, b in zip(c_fast.cache, c_gen.cache):
                    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


def test_second_target_on_one_model_keeps_the_fast_replay_and_the_first_target_works():
    model = tiny_model("qwen3_5")
    first = Target(model, TinyTokenizer.make())
    second = Target(model, TinyTokenizer.make())
    # Wrapping the first Target's taps again hid the mixers and installed the generic replay.
    assert {type(r).__name__ for r in second._replayers.values()} == {"GatedDeltaReplay"}
    assert not any(isinstance(layer.inner, HiddenTap) for layer in model.language_model.model.layers)
    for target in (first, second):
        _, hidden = target.forward(mx.array([_ids(4)]), target.make_cache(), taps=(1, 3))
        assert hidden.shape == (1, 4, 2 * 64)
        rolled, expect = _rollback_case(target, _ids(9), _ids(5, seed=4), keep=2)
        np.testing.assert_allclose(rolled, expect, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="fast_recurrent_replay"):
        Target(model, TinyTokenizer.make(), fast_recurrent_replay=False)


def test_window_cache_attends_exactly_the_window_across_wraps():
    window, reserve = 5, 3
    cache = WindowKVCache(window, reserve)
    keys = mx.array(rng.normal(size=(1, 1, 60, 4)), dtype=mx.float32)
    pos = 0
    for n in [7, 1, 1, 4, 1, 3, 9, 1, 2]:
        mask = cache.make_mask(n, window_size=window, return_array=True)
        k, _ = cache.update_and_fetch(keys[:, :, pos : pos + n], keys[:, :, pos : pos + n])
        # Row i must see exactly the keys at positions (pos+i-window, pos+i].
        stored_first = pos + n - k.shape[2]
        for i in range(n):
            visible = [stored_first + j for j in range(k.shape[2]) if bool(mask[i, j])]
            assert visible == list(range(max(0, pos + i - window + 1), pos + i + 1))
            np.testing.assert_array_equal(np.array(k[0, 0, [v - stored_first for v in visible]]),
                                          np.array(keys[0, 0, visible]))
        pos += n
        if n > 1:
            cache.trim(min(n - 1, reserve))
            pos -= min(n - 1, reserve)


def test_window_cache_refuses_rollback_beyond_reserve():
    cache = WindowKVCache(4, 2)
    kv = mx.zeros((1, 1, 20, 2))
    cache.update_and_fetch(kv, kv)
    while cache.n_stored > 6:  # until the buffer compacts to window - 1 + reserve + 1 rows
        cache.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
    assert cache.n_stored == 6
    with pytest.raises(UnsupportedCacheError, match="window-4"):
        cache.trim(4)
    assert cache.trim(3) == 3


def test_unrollbackable_caches_are_refused_up_front():
    with pytest.raises(UnsupportedCacheError, match=r"layer 1: ChunkedKVCache.*layer 2: RotatingKVCache\(keep=4\)"):
        adapt_cache([KVCache(), ChunkedKVCache(8), RotatingKVCache(16, keep=4)], reserve=4)
    adapted = adapt_cache([KVCache(), RotatingKVCache(16)], reserve=4)
    assert isinstance(adapted[1], WindowKVCache) and adapted[1].window == 16


def test_rollback_is_exact_for_a_model_with_concatenate_caches():
    # ConcatenateKVCache.trim only lowers its offset; the next update appended after stale rows.
    model = tiny_model("llama")
    model.make_cache = lambda: [ConcatenateKVCache() for _ in model.layers]
    target = Target(model, TinyTokenizer.make())
    rolled, expect = _rollback_case(target, _ids(9), _ids(6, seed=7), keep=2)
    np.testing.assert_allclose(rolled, expect, rtol=1e-4, atol=1e-4)


def test_target_refuses_model_with_unsupported_cache():
    model = tiny_model("llama")
    model.make_cache = lambda: [ChunkedKVCache(4) for _ in model.layers]
    target = Target(model, TinyTokenizer.make())
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        target.make_cache()
