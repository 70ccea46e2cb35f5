"""Stacked GatedDeltaNet rollback: one batched replay for all layers equals the per-layer replays."""

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx import generate
from dflash2_mlx.core.caches import RecurrentCache
from dflash2_mlx.core.recurrent import GatedDeltaReplay, MixerReplay, replay_layers, replay_stacked

from test_engine import PROMPT, ScriptedDrafter
from tiny import FAMILIES, tiny_drafter, tiny_target

L = 6  # verify width
# 12 layers, every third full attention: 8 GatedDeltaNet layers share one stack.
DEEP = dict(FAMILIES["qwen3_5"]["text_config"], num_hidden_layers=12, full_attention_interval=3)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 90, size=n).tolist()


@pytest.fixture(scope="module")
def targets():
    """Targets on identical weights: stacked, per-layer fast replay, generic MixerReplay."""
    return {
        "stacked": tiny_target("qwen3_5", text_config=DEEP),
        "per_layer": tiny_target("qwen3_5", text_config=DEEP, stacked_replay=False),
        "generic": tiny_target("qwen3_5", text_config=DEEP, fast_recurrent_replay=False),
    }


@pytest.fixture
def stack_calls(monkeypatch):
    """Group sizes that went through `replay_stacked` (proves the stacked path ran)."""
    import dflash2_mlx.core.recurrent as recurrent

    sizes = []

    def spy(pairs, n, row_n=None):
        sizes.append(len(pairs))
        return replay_stacked(pairs, n, row_n)

    monkeypatch.setattr(recurrent, "replay_stacked", spy)
    return sizes


def _verified_cache(target, batch=1):
    """A cache after a prompt and an armed (not yet committed) verify pass of width L."""
    cache = target.make_cache()
    target.forward(mx.array([_ids(9, seed=b) for b in range(batch)]), cache)
    target.arm(cache)
    target.forward(mx.array([_ids(L, seed=20 + b) for b in range(batch)]), cache)
    return cache


def _recurrent_arrays(cache):
    return [a for c in cache if isinstance(c, RecurrentCache) for a in c.cache]


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("n", range(1, L + 1))
def test_stacked_commit_equals_per_layer_and_generic_replay(targets, stack_calls, n, batch):
    caches = {}
    for name, target in targets.items():
        cache = _verified_cache(target, batch)
        target.commit(cache, n_fed=L, n_keep=n)
        caches[name] = _recurrent_arrays(cache)
    assert stack_calls == ([] if n == L else [8])  # nothing to replay when every token is kept
    _assert_same(caches["stacked"], caches["per_layer"])
    _assert_same(caches["stacked"], caches["generic"])


def test_stacked_replay_of_zero_steps_restores_the_checkpoint(targets):
    target = targets["stacked"]
    cache = _verified_cache(target)
    recurrent = [(target._replayers[i], c) for i, c in enumerate(cache) if isinstance(c, RecurrentCache)]
    checkpoint = [a for _, c in recurrent for a in c.checkpoint]
    replay_layers(recurrent, 0)
    _assert_same(_recurrent_arrays(cache), checkpoint)


def _gdn_layers(target):
    return [(i, r) for i, r in sorted(target._replayers.items()) if isinstance(r, GatedDeltaReplay)]


@pytest.mark.parametrize("n", range(0, L + 1))
def test_stacked_replay_with_a_padding_mask_equals_per_layer(targets, stack_calls, n):
    # A masked batch (left padding) reaches the mixers directly; replay both ways from one tape.
    target = targets["stacked"]
    layers = _gdn_layers(target)
    x = mx.random.normal((2, L, DEEP["hidden_size"]), key=mx.random.key(n))
    mask = mx.array([[True] * L, [False, False] + [True] * (L - 2)])
    results = []
    for stacked in (True, False):
        pairs = []
        for _, replayer in layers:
            cache = RecurrentCache(2)
            replayer(x[:, :3], None, cache)  # some history
            cache.arm()
            replayer(x, mask, cache)
            pairs.append((replayer, cache))
        replay_layers(pairs, n, stacked=stacked)
        results.append([a for _, c in pairs for a in c.cache])
    assert stack_calls == [len(layers)]
    _assert_same(*results)


def test_layers_of_different_shapes_and_generic_layers_replay_on_their_own(stack_calls):
    # Two models' layers in one commit: each shape forms its own stack, a lone layer and a
    # generic MixerReplay layer replay per layer; all equal the per-layer replay.
    narrow = tiny_target("qwen3_5", text_config=DEEP)
    wide_cfg = dict(DEEP, linear_key_head_dim=32, linear_value_head_dim=32, num_hidden_layers=2,
                    full_attention_interval=2)  # one GatedDeltaNet layer
    wide = tiny_target("qwen3_5", text_config=wide_cfg)
    generic = tiny_target("qwen3_5", fast_recurrent_replay=False)
    results = []
    for stacked in (True, False):
        pairs = []
        for target in (narrow, wide, generic):
            cache = _verified_cache(target)
            pairs += [(target._replayers[i], c) for i, c in enumerate(cache) if isinstance(c, RecurrentCache)]
        assert {type(r) for r, _ in pairs} == {GatedDeltaReplay, MixerReplay}
        replay_layers(pairs, 3, stacked=stacked)
        results.append([a for _, c in pairs for a in c.cache])
    assert stack_calls == [8]  # the narrow model's layers; the wide model's lone layer goes per layer
    _assert_same(*results)


@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_greedy_generation_is_identical_with_stacked_per_layer_and_generic_replay(targets, stack_calls,
                                                                                  block_size):
    plain = generate(targets["stacked"], PROMPT, max_tokens=40).tokens
    assert len(set(plain)) > 8
    truth = PROMPT + plain + [3] * 32
    for name, target in targets.items():
        scripted = generate(target, PROMPT, drafter=ScriptedDrafter(target, truth, block_size), max_tokens=40)
        assert scripted.tokens == plain, name
        assert {c.n_accepted for c in scripted.speculative_cycles} == set(range(block_size))
        drafted = generate(target, PROMPT,
                           drafter=tiny_drafter(target, "dflash2", block_size=block_size, n_target_layers=12),
                           max_tokens=40)
        assert drafted.tokens == plain, name
    assert stack_calls and set(stack_calls) == {8}
