"""The DFlash 2 convolution and the candidate selector against float64 NumPy references."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import np_ops

from dflash2_mlx.drafter.conv import GroupedDynamicCausalConv, grouped_dynamic_conv
from dflash2_mlx.drafter.selector import (
    CandidateSelector,
    greedy_walk_ops,
    lattice_ops,
    sampled_walk_ops,
    topk_candidates,
)

from tiny import MASK_ID, tiny_drafter, tiny_target

rng = np.random.default_rng(0)


@pytest.mark.parametrize("L,H,G,K", [(1, 32, 16, 2), (5, 64, 16, 2), (8, 48, 8, 3)])
def test_conv_matches_reference(L, H, G, K):
    x = rng.normal(size=(L, H))
    dyn = rng.normal(size=(L, K, H // G))
    base = rng.normal(size=(K, H))
    ours = grouped_dynamic_conv(mx.array(x, dtype=mx.float32)[None], mx.array(dyn, dtype=mx.float32)[None],
                                mx.array(base, dtype=mx.float32), G)
    ref = np_ops.grouped_dynamic_conv(x, dyn, base, G)
    np.testing.assert_allclose(np.array(ours[0]), ref, rtol=1e-5, atol=1e-5)


def _bf16_half_ulp(ref):
    """Half the bf16 spacing at |ref| (8 significant bits), with a floor at the smallest normal."""
    exponent = np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126)))
    return 2.0 ** (exponent - 8)


@pytest.mark.parametrize("dyn_scale", [0.01, 0.3])
def test_bf16_conv_is_the_rounded_float64_result(dyn_scale):
    # Rounding base + dyn to bf16 before the product lost the small dynamic term.
    L, H, G, K = 8, 256, 16, 2
    as_bf16 = lambda a: mx.array(a, dtype=mx.float32).astype(mx.bfloat16)  # noqa: E731
    x = as_bf16(rng.normal(size=(L, H)))
    dyn = as_bf16(rng.normal(size=(L, K, H // G)) * dyn_scale)
    base = as_bf16(rng.normal(size=(K, H)) * 0.3 + np.array([1.0, 0.0])[:, None])
    ours = grouped_dynamic_conv(x[None], dyn[None], base, G)[0]
    assert ours.dtype == mx.bfloat16
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    ref = np_ops.grouped_dynamic_conv(f64(x), f64(dyn), f64(base), G)
    err = np.abs(f64(ours) - ref)
    off = err > _bf16_half_ulp(ref) * (1 + 1e-3)
    assert not off.any(), f"{off.mean():.1%} not correctly rounded; max error {err.max():.3g}, mean {err.mean():.3g}"


def test_conv_never_crosses_block_boundary():
    conv = GroupedDynamicCausalConv(32, 2, 16)
    conv.base_kernel = mx.array(rng.normal(size=(2, 2, 32)), dtype=mx.float32)
    x = mx.array(rng.normal(size=(1, 3, 4, 32)), dtype=mx.float32)  # three blocks of four
    u, _ = conv.prepare(x)
    for b in range(3):
        alone, _ = conv.prepare(x[:, b])
        np.testing.assert_allclose(np.array(u[:, b]), np.array(alone), rtol=1e-6, atol=1e-6)


def test_conv_identity_at_init():
    conv = GroupedDynamicCausalConv(64, 2, 16)
    x = mx.array(rng.normal(size=(2, 5, 64)), dtype=mx.float32)
    u, dyn = conv.prepare(x)
    np.testing.assert_array_equal(np.array(u), np.array(x))
    np.testing.assert_array_equal(np.array(conv.finish(x * 2, dyn)), np.array(x * 2))


def test_identity_conv_drafter_equals_its_v1_backbone():
    target = tiny_target("qwen3")
    v2 = tiny_drafter(target, "dflash2", identity_conv=True)
    v1 = tiny_drafter(target, "dflash")
    v2_params = dict(tree_flatten(v2.parameters()))
    v1.load_weights([(k, v2_params[k]) for k, _ in tree_flatten(v1.parameters())])
    ctx = mx.array(rng.normal(size=(1, 9, 3 * 64)), dtype=mx.float32)
    block = mx.array([[5] + [MASK_ID] * 7])
    h1 = v1.hidden_states(block, ctx, v1.make_cache())
    h2 = v2.hidden_states(block, ctx, v2.make_cache())
    np.testing.assert_allclose(np.array(h1), np.array(h2), rtol=1e-6, atol=1e-6)


def _selector_case(L=5, k=6, r=8, V=37, B=1):
    cands = np.stack([np.stack([rng.choice(V, size=k, replace=False) for _ in range(L)]) for _ in range(B)])
    unary = rng.normal(size=(B, L, k))
    gate = rng.normal(size=(B, L, r))
    A, Bc = rng.normal(size=(V, r)), rng.normal(size=(V, r))
    anchor = rng.integers(0, V, size=(B,))
    return cands, unary, gate, A, Bc, anchor


def _mx(*arrays):
    return [mx.array(a, dtype=mx.int32 if a.dtype.kind in "iu" else mx.float32) for a in arrays]


@pytest.mark.parametrize("L,k,r", [(1, 4, 8), (5, 6, 8), (7, 16, 256)])
def test_lattice_and_greedy_walk_match_brute_force(L, k, r):
    cands, unary, gate, A, Bc, anchor = _selector_case(L, k, r, V=53, B=2)
    lat = lattice_ops(*_mx(cands, unary, gate, A, Bc, anchor))
    path = greedy_walk_ops(lat)
    for b in range(2):
        ref = np_ops.selector_lattice(cands[b], unary[b], gate[b], A, Bc, anchor[b])
        np.testing.assert_allclose(np.array(lat[b]), ref, rtol=1e-4, atol=1e-4)
        assert np.array(path[b]).tolist() == np_ops.greedy_walk(ref)


def test_sampled_walk_matches_reference_and_q_rows_are_distributions():
    cands, unary, gate, A, Bc, anchor = _selector_case(L=6, k=8, r=4, V=29)
    lat = lattice_ops(*_mx(cands, unary, gate, A, Bc, anchor))
    uniforms = rng.uniform(size=(1, 6))
    idx, q = sampled_walk_ops(lat, 0.7, mx.array(uniforms, dtype=mx.float32))
    ref_lat = np_ops.selector_lattice(cands[0], unary[0], gate[0], A, Bc, anchor[0])
    ref_path, ref_q = np_ops.sampled_walk(ref_lat, 0.7, uniforms[0])
    assert np.array(idx[0]).tolist() == ref_path
    np.testing.assert_allclose(np.array(q[0]), ref_q, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(q.sum(-1)), 1.0, atol=1e-5)


def test_zero_codebook_walk_is_per_position_argmax():
    selector = CandidateSelector(hidden_size=16, vocab_size=41, rank=4, top_k=5)
    selector.predecessor_codebook.weight = mx.zeros((41, 4))
    logits = mx.array(rng.normal(size=(1, 6, 41)), dtype=mx.float32)
    out = selector(mx.array(rng.normal(size=(1, 6, 16)), dtype=mx.float32), logits, mx.array([3]), 0.0)
    assert out.tokens.tolist() == mx.argmax(logits, axis=-1).tolist()


def test_topk_candidates_sorted_and_exact():
    logits = mx.array(rng.normal(size=(2, 3, 97)), dtype=mx.float32)
    cands, unary = topk_candidates(logits, 16)
    ref = np.argsort(-np.array(logits), axis=-1)[..., :16]
    assert np.array(cands).tolist() == ref.tolist()
    assert np.all(np.diff(np.array(unary), axis=-1) <= 0)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("window,causal", [(None, False), (6, False), (6, True)])
def test_drafter_forward_matches_float64_reference(arch, window, causal):
    from reference.np_drafter import drafter_forward

    target = tiny_target("llama")
    types = ["full_attention", "full_attention"] if window is None else ["sliding_attention", "full_attention"]
    drafter = tiny_drafter(target, arch, block_size=5, layer_types=types, sliding_window=window or 16,
                           is_causal=causal)
    params = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}
    ctx = rng.normal(size=(11, 3 * 64))
    block = [7] + [MASK_ID] * 4
    ours = drafter.hidden_states(mx.array([block]), mx.array(ctx[None], dtype=mx.float32), drafter.make_cache())
    embed = np.array(target.inner.embed_tokens.weight, dtype=np.float64)
    ref = drafter_forward(params, drafter.config, np.array(block), ctx, embed)
    np.testing.assert_allclose(np.array(ours[0]), ref, rtol=2e-4, atol=2e-4)
