"""Caches that speculative decoding can roll back exactly.

mlx-lm's caches assume one token per step or a prompt; speculation feeds a block of
`width` tokens and then keeps only a prefix of it. Three cache kinds need help:

* `RotatingKVCache` (sliding-window layers) grows past its window under multi-token
  updates (mlx-lm #1914) and cannot be trimmed once the ring wraps. `WindowKVCache`
  replaces it: it keeps `window - 1 + reserve` rows of history in temporal order, masks
  to exactly the window, and so can always drop up to `reserve` rows.
* `ArraysCache` (GatedDeltaNet, Mamba, ...) holds recurrent state that cannot be trimmed.
  `RecurrentCache` adds a checkpoint taken before a verify pass and a tape the layer
  wrappers in `recurrent.py` fill, so the state after any prefix can be rebuilt.
* `ConcatenateKVCache` claims to be trimmable, but `trim` only lowers its offset and the
  next update appends after the dropped rows. `KVCache` (same contract) replaces it.

Invariant for both: after `trim`/rollback the cache equals, up to float rounding of the
batched computation, the cache of a model that was only ever fed the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

from ..errors import UnsupportedCacheError


class WindowKVCache(_BaseCache):
    """KV cache for a sliding-window layer: query at position p sees keys in (p - window, p].

    Rows are stored contiguously in temporal order; the last stored row is position
    `offset - 1`. After each update at least `window - 1 + reserve` rows of history are
    kept (when that many exist), so `trim(n)` is exact for any `n <= reserve`.
    """

    step = 256

    def __init__(self, window: int, reserve: int):
        if window < 1 or reserve < 0:
            raise ValueError(f"window must be >= 1 and reserve >= 0, got {window}, {reserve}")
        self.window = window
        self.reserve = reserve
        self.history = window - 1 + reserve
        self.keys = None
        self.values = None
        self.offset = 0
        self.n_stored = 0

    def _rows_before_write(self, n_new: int) -> int:
        # Pure function of the state so make_mask (called before the update) and
        # update_and_fetch agree on how many history rows precede the new ones.
        if self.keys is not None and self.n_stored + n_new <= self.keys.shape[2]:
            return self.n_stored
        return min(self.n_stored, self.history)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n_new = keys.shape[2]
        n_prev = self._rows_before_write(n_new)
        # A restored or cloned cache holds exactly its rows: no room means a new buffer too.
        if self.keys is None or n_prev != self.n_stored or n_prev + n_new > self.keys.shape[2]:
            size = (n_prev + n_new + self.step - 1) // self.step * self.step + self.step
            B, n_kv, _, d_k = keys.shape
            new_k = mx.zeros((B, n_kv, size, d_k), keys.dtype)
            new_v = mx.zeros((B, n_kv, size, values.shape[3]), values.dtype)
            if n_prev:
                start = self.n_stored - n_prev
                new_k[..., :n_prev, :] = self.keys[..., start : self.n_stored, :]
                new_v[..., :n_prev, :] = self.values[..., start : self.n_stored, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., n_prev : n_prev + n_new, :] = keys
        self.values[..., n_prev : n_prev + n_new, :] = values
        self.n_stored = n_prev + n_new
        self.offset += n_new
        return self.keys[..., : self.n_stored, :], self.values[..., : self.n_stored, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = min(window_size or self.window, self.window)
        n_prev = self._rows_before_write(N)
        if N == 1 and n_prev < window and not return_array:
            return None
        query = mx.arange(n_prev, n_prev + N)[:, None]
        key = mx.arange(n_prev + N)[None]
        return (key <= query) & (query - key < window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        needed = min(self.offset - n, self.window - 1)
        if self.n_stored - n < needed:
            raise UnsupportedCacheError(
                f"cannot roll back {n} tokens of a window-{self.window} cache holding "
                f"{self.n_stored} rows (reserve {self.reserve}); raise the reserve"
            )
        self.n_stored -= n
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.n_stored

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.n_stored = v

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass(slots=True)
class Tape:
    """What the wrappers of one recurrent layer record during an armed verify pass (recurrent.py)."""

    replay: tuple | None = None  # (block input, mask): the generic MixerReplay re-runs the module
    inputs: mx.array | None = None  # GatedDeltaNet: the block input
    mask: object = None
    conv_input: mx.array | None = None  # the depthwise conv's input, state rows included
    a: mx.array | None = None  # the gate projections' outputs
    b: mx.array | None = None


class RecurrentCache(ArraysCache):
    """ArraysCache with a checkpoint and a tape for exact rollback after a verify pass.

    `arm()` snapshots the state arrays (MLX arrays are immutable, so keeping references is
    a free snapshot) and opens a tape; the layer wrapper of this cache records what it
    needs to replay a prefix of the block; `disarm()` drops both.
    """

    def __init__(self, size: int):
        super().__init__(size)
        self.checkpoint: list | None = None
        self.tape: Tape | None = None

    def arm(self) -> None:
        self.checkpoint = list(self.cache)
        self.tape = Tape()

    def disarm(self) -> None:
        self.checkpoint = None
        self.tape = None

    def restore(self) -> None:
        if self.checkpoint is None:
            raise RuntimeError("RecurrentCache.restore() without a checkpoint (call arm() first)")
        self.cache = list(self.checkpoint)


# mlx-lm's kinds speculation takes as they are (their trim is exact)
TRIMMABLE_KINDS = (KVCache, QuantizedKVCache, WindowKVCache)


def _as_kv_cache(c: ConcatenateKVCache) -> KVCache:
    kv = KVCache()
    if c.keys is not None:
        kv.keys, kv.values, kv.offset = c.keys, c.values, c.offset
    return kv


def adapt_cache(cache: list, reserve: int) -> list:
    """Swap the cache kinds speculation cannot roll back for exact equivalents.

    Raises `UnsupportedCacheError` listing every layer whose cache kind has no exact
    rollback, before anything runs.
    """
    adapted, refused = [], []
    for i, c in enumerate(cache):
        if isinstance(c, RotatingKVCache):
            if c.keep:
                refused.append(f"layer {i}: RotatingKVCache(keep={c.keep})")
            adapted.append(WindowKVCache(c.max_size, reserve))
        elif type(c) is ArraysCache:
            adapted.append(RecurrentCache(len(c.cache)))
        elif type(c) is ConcatenateKVCache:
            adapted.append(_as_kv_cache(c))
        elif isinstance(c, TRIMMABLE_KINDS):
            adapted.append(c)
        else:
            refused.append(f"layer {i}: {type(c).__name__}")
            adapted.append(c)
    if refused:
        raise UnsupportedCacheError(
            "speculative decoding needs exact cache rollback, which is not available for "
            + ", ".join(refused)
        )
    return adapted
