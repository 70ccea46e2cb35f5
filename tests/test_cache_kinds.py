"""Each cache kind's adapter keeps the contract the prompt cache, the batch and the drafter rely
on: a snapshot restores exactly, a copy is independent, a saved layer loads back equal, bytes are
the stored arrays', and what a kind cannot do is refused naming it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from dflash2_mlx.core.cache_kinds import cache_nbytes, can_trim, clone, kind_of, restore, snapshot
from dflash2_mlx.core.caches import RecurrentCache, WindowKVCache
from dflash2_mlx.errors import UnsupportedCacheError

KINDS = ["KVCache", "QuantizedKVCache", "WindowKVCache", "RecurrentCache"]


def _make(name: str):
    return {"KVCache": KVCache, "QuantizedKVCache": lambda: QuantizedKVCache(group_size=32, bits=8),
            "WindowKVCache": lambda: WindowKVCache(window=6, reserve=4),
            "RecurrentCache": lambda: RecurrentCache(2)}[name]()


def _feed(cache, n: int, seed: int) -> None:
    """`n` more tokens' worth of state (random, so two feeds differ)."""
    a = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))
    if isinstance(cache, RecurrentCache):
        cache.cache = [a[:, :, -1], a.sum(axis=2)]
    else:
        cache.update_and_fetch(a, 2 * a)


def _state(cache) -> list[np.ndarray]:
    """What the layer holds, as numpy (a quantized cache's data, scales and biases)."""
    meta, parts = kind_of(cache).pack(cache)
    return [meta] + [np.array(p) for p in parts]


def _equal(a: list, b: list) -> bool:
    return a[0] == b[0] and len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("name", KINDS)
def test_a_snapshot_brings_the_layer_back_exactly(name):
    cache = _make(name)
    _feed(cache, 9, 0)
    before, snap = _state(cache), snapshot(cache)
    _feed(cache, 3, 1)  # moves on: a K/V layer comes back by trimming, a window and a state from the snapshot
    assert not _equal(_state(cache), before)
    restore(cache, snap)
    assert _equal(_state(cache), before)


@pytest.mark.parametrize("name", KINDS)
def test_a_copy_is_independent_and_a_saved_layer_loads_back_equal(name):
    cache = _make(name)
    _feed(cache, 7, 0)
    before = _state(cache)
    other = clone(cache)
    _feed(other, 2, 1)
    assert _equal(_state(cache), before) and not _equal(_state(other), before)
    meta, parts = kind_of(cache).pack(cache)
    loaded = _make(name)
    kind_of(loaded).unpack(loaded, meta, parts)
    assert _equal(_state(loaded), before)
    assert cache_nbytes(cache) >= sum(p.nbytes for p in parts if p is not None) > 0


def test_trims_reach_what_each_kind_allows():
    kv, window, recurrent = _make("KVCache"), _make("WindowKVCache"), _make("RecurrentCache")
    for c in (kv, window, recurrent):
        _feed(c, 20, 0)
        restore(c, snapshot(c))  # a restored window holds exactly its rows: its next write keeps 5 + 4
        _feed(c, 1, 1)
    assert can_trim(kv, 21) and not can_trim(kv, 22)
    # window 6, reserve 4: 5 + 4 rows of history kept, plus the new one; 5 must stay
    assert window.n_stored == 10 and can_trim(window, 5) and not can_trim(window, 6)
    assert can_trim(recurrent, 0) and not can_trim(recurrent, 1)
    with pytest.raises(UnsupportedCacheError, match="a RecurrentCache cannot drop 1 tokens"):
        kind_of(recurrent).trim(recurrent, 1)


def test_what_a_kind_cannot_do_is_refused_naming_it():
    with pytest.raises(UnsupportedCacheError, match="does not handle a RotatingKVCache"):
        kind_of(RotatingKVCache(max_size=8))
    quantized = _make("QuantizedKVCache")
    with pytest.raises(UnsupportedCacheError, match="a QuantizedKVCache cannot give its stored keys and values "
                                                    "unquantized"):
        kind_of(quantized).stored(quantized)
    recurrent = _make("RecurrentCache")
    with pytest.raises(UnsupportedCacheError, match="a RecurrentCache cannot give its stored keys"):
        kind_of(recurrent).stored(recurrent)


def test_the_exact_class_lookup_gives_the_kind_the_isinstance_scan_gives():
    from dflash2_mlx.core import cache_kinds

    for cls, _ in cache_kinds._KINDS:  # a subclass listed after its base would make the two disagree
        scanned = next(kind for base, kind in cache_kinds._KINDS if issubclass(cls, base))
        assert cache_kinds._BY_TYPE[cls] is scanned, cls.__name__
