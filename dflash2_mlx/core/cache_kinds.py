"""What each kind of layer cache does, in one place: `kind_of(cache)` and its adapter.

Speculation, prompt caches and the batch handle five kinds of per-layer cache: mlx-lm's
`KVCache` and `QuantizedKVCache`, and this package's `WindowKVCache`, `RecurrentCache`
(`caches.py`) and `RaggedKVCache` (`ragged.py`, a batch's rows). Everything that differs between
them is a method of its kind here: how far a trim reaches, what a snapshot keeps and costs, the
bytes held, how a copy shares buffers, how a layer is written to a file, how a row joins and
leaves a batch. A kind that cannot do something refuses in one line naming the kind and the
operation (`UnsupportedCacheError`). The module functions at the end are what callers use.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..errors import UnsupportedCacheError
from .caches import RecurrentCache, WindowKVCache
from .ragged import RaggedKVCache, each, parts


class CacheKind(Protocol):
    """One layer cache kind's behaviour (methods take the cache they act on)."""

    name: str
    replays: bool  # rolled back by replaying a recorded tape (recurrent state), never trimmed
    needs_mark: bool  # cannot drop any number of tokens: a prompt cache keeps a snapshot for it

    def can_trim(self, cache, n: int) -> bool: ...
    def trim(self, cache, n: int) -> None: ...
    def stored(self, cache) -> tuple[mx.array, mx.array]: ...
    def snapshot(self, cache) -> object: ...
    def restore(self, cache, snap) -> None: ...
    def snapshot_nbytes(self, snap, live: set[int]) -> int: ...
    def nbytes(self, cache) -> int: ...
    def live_arrays(self, cache) -> list: ...
    def clone(self, cache): ...
    def pack(self, cache) -> tuple[dict, list]: ...
    def unpack(self, cache, meta: dict, parts: list) -> None: ...
    def empty_batch(self, cache): ...
    def rows(self, cache) -> tuple[mx.array, mx.array, mx.array, int]: ...
    def add_rows(self, batched, rows: list) -> None: ...
    def keep_rows(self, batched, rows: list[int]) -> None: ...
    def row_cache(self, batched, row: int, reserve: int): ...
    def batch_size(self, batched) -> int | None: ...
    def compact(self, batched) -> None: ...


class _Kind:
    """Defaults: refuse, naming the kind and what was asked of it."""

    name = "cache"
    replays = False
    needs_mark = False

    def _refuse(self, what: str):
        raise UnsupportedCacheError(f"a {self.name} cannot {what}")

    def can_trim(self, cache, n: int) -> bool:
        return n <= 0

    def trim(self, cache, n: int) -> None:
        if n:
            self._refuse(f"drop {n} tokens")

    def stored(self, cache):
        self._refuse("give its stored keys and values")

    def snapshot(self, cache):
        self._refuse("be snapshotted")

    def restore(self, cache, snap) -> None:
        self._refuse("be restored")

    def snapshot_nbytes(self, snap, live: set[int]) -> int:
        return 0

    def nbytes(self, cache) -> int:
        return 0

    def live_arrays(self, cache) -> list:
        return []

    def clone(self, cache):
        self._refuse("be copied")

    def pack(self, cache) -> tuple[dict, list]:
        self._refuse("be saved")

    def unpack(self, cache, meta: dict, parts: list) -> None:
        self._refuse("be loaded")

    def empty_batch(self, cache):
        self._refuse("join a speculative batch")

    def rows(self, cache):
        self._refuse("join a speculative batch")

    def add_rows(self, batched, rows: list) -> None:
        self._refuse("take batch rows")

    def keep_rows(self, batched, rows: list[int]) -> None:
        self._refuse("drop batch rows")

    def row_cache(self, batched, row: int, reserve: int):
        self._refuse("give a batch row back")

    def batch_size(self, batched) -> int | None:
        return None

    def compact(self, batched) -> None:
        pass


class _KV(_Kind):
    """mlx-lm's `KVCache`: rows stored in order from position 0; a trim lowers the offset."""

    name = "KVCache"

    def can_trim(self, cache, n: int) -> bool:
        return n <= cache.offset

    def trim(self, cache, n: int) -> None:
        cache.trim(n)

    def snapshot(self, cache):
        return cache.offset  # what a later trim reaches exactly: nothing is copied

    def restore(self, cache, snap) -> None:
        if cache.offset < snap:
            raise ValueError(f"cannot restore a cache at offset {cache.offset} to offset {snap}")
        cache.trim(cache.offset - snap)

    def _stored(self, cache) -> int:
        return cache.offset

    def stored(self, cache) -> tuple[mx.array, mx.array]:
        """The keys and values it holds, oldest first, without appending."""
        n = self._stored(cache)
        return cache.keys[..., :n, :], cache.values[..., :n, :]

    def _parts(self, cache) -> tuple:
        return cache.keys, cache.values

    def nbytes(self, cache) -> int:
        return 0 if cache.keys is None else sum(a.nbytes for a in self._parts(cache))

    def clone(self, cache):
        out = KVCache()
        if cache.keys is not None:
            out.keys, out.values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        out.offset = cache.offset
        return out

    def pack(self, cache) -> tuple[dict, list]:
        if cache.keys is None:
            return {"kind": type(cache).__name__, "offset": 0, "empty": True}, []
        n = self._stored(cache)
        parts = [a[..., :n, :] for a in self._parts(cache)]
        return {"kind": type(cache).__name__, "offset": cache.offset, "n": n, "parts": len(parts)}, parts

    def unpack(self, cache, meta: dict, parts: list) -> None:
        if meta.get("empty"):
            return
        cache.keys, cache.values = parts
        cache.offset = meta["offset"]

    def empty_batch(self, cache):
        if type(cache) is not KVCache:
            self._refuse_subclass(cache)
        return RaggedKVCache()

    def _refuse_subclass(self, cache):
        raise UnsupportedCacheError(f"a {type(cache).__name__} cannot join a speculative batch")

    def rows(self, cache):
        if type(cache) is not KVCache:
            self._refuse_subclass(cache)
        return _single_rows(cache, 0, cache.offset)


class _Quantized(_KV):
    """mlx-lm's `QuantizedKVCache`: as `KVCache`, its keys and values (data, scales, biases) tuples."""

    name = "QuantizedKVCache"

    def _parts(self, cache) -> tuple:
        return (*cache.keys, *cache.values)

    def stored(self, cache):
        self._refuse("give its stored keys and values unquantized")

    def clone(self, cache):
        out = QuantizedKVCache(cache.group_size, cache.bits)
        if cache.keys is not None:
            n = cache.offset
            out.keys, out.values = (tuple(a[..., :n, :] for a in part) for part in (cache.keys, cache.values))
        out.offset = cache.offset
        return out

    def unpack(self, cache, meta: dict, parts: list) -> None:
        if meta.get("empty"):
            return
        half = len(parts) // 2
        cache.keys, cache.values = tuple(parts[:half]), tuple(parts[half:])
        cache.offset = meta["offset"]

    def empty_batch(self, cache):
        if type(cache) is not QuantizedKVCache:
            self._refuse_subclass(cache)
        return RaggedKVCache(quantized=(cache.group_size, cache.bits))

    def rows(self, cache):
        if type(cache) is not QuantizedKVCache:
            self._refuse_subclass(cache)
        return _single_rows(cache, 0, cache.offset)


class _Window(_KV):
    """`WindowKVCache`: the last `window - 1 + reserve` rows; a trim must leave a full window."""

    name = "WindowKVCache"
    needs_mark = True

    def can_trim(self, cache, n: int) -> bool:
        if n <= 0:
            return True
        return n <= cache.offset and cache.n_stored - n >= min(cache.offset - n, cache.window - 1)

    def snapshot(self, cache):
        if cache.keys is None:
            return None
        n = cache.n_stored
        # copies, not views: a view would keep the cache's whole buffer alive once it moves on
        k, v = mx.contiguous(cache.keys[..., :n, :]), mx.contiguous(cache.values[..., :n, :])
        mx.eval(k, v)
        return k, v, cache.offset, n

    def restore(self, cache, snap) -> None:
        if snap is None:
            cache.keys = cache.values = None
            cache.offset = cache.n_stored = 0
            return
        k, v, cache.offset, cache.n_stored = snap
        # Fresh slices: an in-place write into the restored cache must leave the snapshot whole.
        cache.keys, cache.values = k[..., : cache.n_stored, :], v[..., : cache.n_stored, :]

    def snapshot_nbytes(self, snap, live: set[int]) -> int:
        return 0 if snap is None else snap[0].nbytes + snap[1].nbytes

    def _stored(self, cache) -> int:
        return cache.n_stored

    def clone(self, cache):
        out = WindowKVCache(cache.window, cache.reserve)
        if cache.keys is not None:
            n = cache.n_stored
            out.keys, out.values = cache.keys[..., :n, :], cache.values[..., :n, :]
        out.offset, out.n_stored = cache.offset, cache.n_stored
        return out

    def unpack(self, cache, meta: dict, parts: list) -> None:
        super().unpack(cache, meta, parts)
        if not meta.get("empty"):
            cache.n_stored = meta["n"]

    def empty_batch(self, cache):
        return RaggedKVCache(cache.window)

    def rows(self, cache):
        return _single_rows(cache, cache.offset - cache.n_stored, cache.n_stored)


class _Recurrent(_Kind):
    """`RecurrentCache`: a state per row (GatedDeltaNet, Mamba, ...), rolled back by replaying
    its tape; one row in the engine, every row of a batch in the batch."""

    name = "RecurrentCache"
    replays = True
    needs_mark = True

    def snapshot(self, cache):
        return list(cache.cache)  # the layers replace these arrays, never write into them

    def restore(self, cache, snap) -> None:
        cache.cache = list(snap)

    def snapshot_nbytes(self, snap, live: set[int]) -> int:
        return sum(a.nbytes for a in snap if a is not None and id(a) not in live)

    def nbytes(self, cache) -> int:
        return sum(a.nbytes for a in self.live_arrays(cache))

    def live_arrays(self, cache) -> list:
        return [a for a in cache.cache if a is not None]

    def clone(self, cache):
        out = type(cache)(len(cache.cache))
        out.cache = list(cache.cache)
        return out

    def pack(self, cache) -> tuple[dict, list]:
        return {"kind": self.name, "n": len(cache.cache)}, list(cache.cache)

    def unpack(self, cache, meta: dict, parts: list) -> None:
        cache.cache = parts

    def empty_batch(self, cache):
        return RecurrentCache(len(cache.cache))

    def add_rows(self, batched, rows: list) -> None:
        if any(part is None for r in rows for part in r.cache):
            raise ValueError("a row joins the batch after its prompt was prefilled")
        for r in rows:  # mlx-lm's ArraysCache.extend, once the batch holds a row
            if batched.cache[0] is None:
                batched.cache = list(r.cache)
            else:
                batched.extend(r)

    def keep_rows(self, batched, rows: list[int]) -> None:
        if rows:
            batched.filter(mx.array(rows, mx.int32))  # mlx-lm's ArraysCache.filter
        else:
            batched.cache = [None] * len(batched.cache)

    def row_cache(self, batched, row: int, reserve: int):
        single = RecurrentCache(len(batched.cache))
        # a row slice is a view of the batch's state: copy it so the batch can be freed
        single.cache = [mx.contiguous(a[row : row + 1]) if a is not None else None for a in batched.cache]
        mx.eval([a for a in single.cache if a is not None])
        return single

    def batch_size(self, batched) -> int | None:
        return None if batched.cache[0] is None else int(batched.cache[0].shape[0])


class _Ragged(_Kind):
    """`RaggedKVCache`: a batch's K/V rows, each rolled back by its own `commit`."""

    name = "RaggedKVCache"

    def nbytes(self, cache) -> int:
        return cache.nbytes

    def add_rows(self, batched, rows: list) -> None:
        batched.add_rows([kind_of(c).rows(c) for c in rows])

    def keep_rows(self, batched, rows: list[int]) -> None:
        batched.keep_rows(rows)

    def row_cache(self, batched, row: int, reserve: int):
        return batched.row_cache(row, reserve)

    def batch_size(self, batched) -> int | None:
        return batched.batch_size

    def compact(self, batched) -> None:
        batched.compact()


def _single_rows(cache, first: int, n: int) -> tuple[mx.array, mx.array, mx.array, int]:
    """(keys, values, positions, length) of a single-row cache's `n` stored rows from `first`
    (quantized keys and values as (data, scales, biases) tuples)."""
    if cache.keys is None or n == 0:
        raise ValueError("a row joins the batch after its prompt was prefilled (its cache is empty)")
    if (rows := parts(cache.keys)[0].shape[0]) != 1:
        raise ValueError(f"a batch takes single-row caches, got a batch of {rows}")
    pos = mx.arange(first, first + n, dtype=mx.int32)[None]
    keys, values = (each(lambda a: a[..., :n, :], x) for x in (cache.keys, cache.values))
    return keys, values, pos, cache.offset


# Subclasses first: RecurrentCache is an ArraysCache, and KVCache subclasses trim as it does.
_KINDS: tuple[tuple[type, CacheKind], ...] = (
    (WindowKVCache, _Window()),
    (RaggedKVCache, _Ragged()),
    (RecurrentCache, _Recurrent()),
    (QuantizedKVCache, _Quantized()),
    (KVCache, _KV()),
)


_BY_TYPE: dict[type, CacheKind] = dict(_KINDS)  # the exact classes: one lookup per layer on the decode path


def kind_of(cache) -> CacheKind:
    """The adapter of `cache`'s kind; a cache of another kind is refused, named."""
    kind = _BY_TYPE.get(type(cache))
    if kind is not None:
        return kind
    for cls, kind in _KINDS:
        if isinstance(cache, cls):
            return kind
    raise UnsupportedCacheError(f"speculative decoding does not handle a {type(cache).__name__} cache")


# -- what callers use --------------------------------------------------------------------------


def can_trim(cache, n: int) -> bool:
    """Whether dropping the last `n` tokens of `cache` is exact (a recurrent state never is)."""
    return n <= 0 or kind_of(cache).can_trim(cache, n)


def snapshot(cache):
    """What `restore` needs to bring `cache` back to its state now, without copying what a trim
    reaches exactly: the offset of a KV cache, a copy of a window's rows, a recurrent state."""
    return kind_of(cache).snapshot(cache)


def restore(cache, snap) -> None:
    """Bring `cache` back to `snapshot(cache)`'s state (a KV cache must not have been trimmed below it)."""
    kind_of(cache).restore(cache, snap)


def cache_nbytes(cache) -> int:
    """Bytes a cache holds (0 when empty)."""
    return kind_of(cache).nbytes(cache)


def clone(cache):
    """An independent copy of `cache` (sharing buffers until either one writes: MLX copies
    on write into a buffer that something else still holds)."""
    return kind_of(cache).clone(cache)
