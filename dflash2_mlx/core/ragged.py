"""Batched caches whose rows roll back by different amounts: speculation across a batch.

A batched verify feeds every row the same `width` tokens, but each row keeps its own prefix
of them. mlx-lm's `BatchKVCache` shares one write index and left padding across rows, so it
can only drop the same count from every row. `RaggedKVCache` gives each slot an absolute
position instead (-1 = empty): a row drops its rejected tokens by emptying their slots, its
attention mask is built from the positions, and RoPE reads each row's own length. Empty
slots accumulate (a row that kept fewer tokens than its neighbours leaves holes);
`compact` packs them away, and for a sliding-window layer also the slots no query can see.

With `quantized` (group size, bits) the slots hold mlx-lm's quantized (data, scales, biases)
groups, stored as a `QuantizedKVCache` stores them. A pass reads them as a single row's would
(`kv_attention.float_reads`): their float copy (`unpack_groups`) as `FloatReadView` gives it, or,
for a short pass off the CPU, the groups themselves with `bits` set, so that mlx-lm's attention
takes its quantized path. A batched row then computes what it computes alone.

Recurrent layers keep their batched `RecurrentCache` (per-row state); `commit_rows` replays
each row's kept prefix (`recurrent.replay_layers` with per-row counts).

Rows enter as single-row engine caches' stored rows (`add_rows`, after a row's prompt is
prefilled alone) and leave by index (`keep_rows`); `row_cache` gives a row back as a single-row
engine cache (for the prompt cache). The whole model's batched caches: `batch_cache.py`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache

from . import kv_attention
from .caches import WindowKVCache

COMPACT_MIN_SLOTS = 64  # below this many slots holes cost less than packing them
# Slots kept past a window when packing, so that a row leaving the batch can still drop its last
# tokens exactly (a prompt cache's next turn trims back to where it diverges); as PromptCache's reserve.
WINDOW_SPARE = 64


class RaggedKVCache(_BaseCache):
    """Batched K/V with an absolute position per slot; `window` for sliding-window layers,
    `quantized` (group size, bits) for quantized K/V.

    keys/values [B, H, S, D], or with `quantized` tuples of mlx-lm's (data, scales, biases),
    each [B, H, S, ...]; `pos` [B, S] int32 (-1: empty); `lengths` [B] int32, the next
    position of each row (RoPE's offset). After `update_and_fetch` of N tokens, `lengths`
    includes them until `commit` keeps each row's prefix.
    """

    step = 256

    def __init__(self, window: int | None = None, spare: int = WINDOW_SPARE,
                 quantized: tuple[int, int] | None = None):
        if window is not None and quantized is not None:
            raise ValueError(f"a sliding-window layer (window {window}) cannot hold quantized K/V")
        self.window, self.spare, self.quantized = window, spare, quantized
        self.quantized_read = False  # whether the last pass reads the groups themselves (see `bits`)
        self.keys = self.values = None
        self.pos = mx.zeros((0, 0), mx.int32)
        self.lengths = mx.zeros((0,), mx.int32)
        self.n_slots = 0

    # -- what the model reads ---------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        return self.lengths

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def _new_positions(self, N: int) -> mx.array:
        return self.lengths[:, None] + mx.arange(N, dtype=mx.int32)[None]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """[B, 1, N, S + N] bool: query j of row b sees the filled slots at positions up to its
        own and, in a window, within it (the N new slots included)."""
        windows = [w for w in (window_size, self.window) if w]
        query = self._new_positions(N)
        key = mx.concatenate([self.pos[:, : self.n_slots], query], axis=1)[:, None, :]
        query = query[:, :, None]
        mask = (key >= 0) & (key <= query)
        if windows:
            mask = mask & (query - key < min(windows))
        return mask[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        if self.quantized is not None:  # stored as QuantizedKVCache.update_and_fetch stores them
            group, bits = self.quantized
            keys = tuple(mx.quantize(keys, group_size=group, bits=bits))
            values = tuple(mx.quantize(values, group_size=group, bits=bits))
        start = self.n_slots
        if self.keys is None or start + N > parts(self.keys)[0].shape[2]:
            self._grow(keys, values, start + N)
        for stored, new in zip(parts(self.keys) + parts(self.values), parts(keys) + parts(values)):
            stored[..., start : start + N, :] = new
        self.pos[:, start : start + N] = self._new_positions(N)
        self.n_slots = start + N
        self.lengths = self.lengths + N
        self.quantized_read = self.quantized is not None and not kv_attention.float_reads(N)
        return self._read(self.keys), self._read(self.values)

    def _read(self, stored):
        """The filled slots as the layer attends to them: float, dequantized where stored quantized
        unless this pass reads the groups themselves."""
        live = each(lambda a: a[..., : self.n_slots, :], stored)
        if self.quantized is None or self.quantized_read:
            return live
        group, bits = self.quantized
        return kv_attention.float_copy(live, group, bits)

    # mlx-lm's `scaled_dot_product_attention` takes its quantized path by `hasattr(cache, "bits")`:
    # present only for a pass that reads the groups themselves, as for a lone `QuantizedKVCache`
    @property
    def bits(self) -> int:
        if not self.quantized_read:
            raise AttributeError("bits: this pass reads float K/V")
        return self.quantized[1]

    @property
    def group_size(self) -> int:
        if not self.quantized_read:
            raise AttributeError("group_size: this pass reads float K/V")
        return self.quantized[0]

    def _grow(self, keys, values, needed: int) -> None:
        size = (needed + self.step - 1) // self.step * self.step

        def fresh(a: mx.array) -> mx.array:
            return mx.zeros((a.shape[0], a.shape[1], size, a.shape[3]), a.dtype)

        new_k, new_v = each(fresh, keys), each(fresh, values)
        new_pos = mx.full((parts(keys)[0].shape[0], size), -1, mx.int32)
        if self.keys is not None and self.n_slots:
            n = self.n_slots
            for new, old in zip(parts(new_k) + parts(new_v), parts(self.keys) + parts(self.values)):
                new[..., :n, :] = old[..., :n, :]
            new_pos[:, :n] = self.pos[:, :n]
        self.keys, self.values, self.pos = new_k, new_v, new_pos

    # -- per-row rollback -------------------------------------------------------------------

    def commit(self, n_fed: int, n_keep: list[int]) -> None:
        """Keep the first `n_keep[b]` of the `n_fed` tokens each row got in the last update."""
        start = self.n_slots - n_fed
        keep = mx.array(n_keep, mx.int32)
        fed = mx.arange(n_fed, dtype=mx.int32)[None]
        block = self.pos[:, start : self.n_slots]
        self.pos[:, start : self.n_slots] = mx.where(fed < keep[:, None], block, -1)
        self.lengths = self.lengths - n_fed + keep
        self.n_slots = start + max(n_keep)  # slots no row kept are free again

    def compact(self) -> bool:
        """Pack each row's live slots to the front (dropping slots more than `spare` past a
        window); whether it did (only when at least a quarter of the slots, and
        `COMPACT_MIN_SLOTS`, are dead)."""
        if self.n_slots < COMPACT_MIN_SLOTS or self.keys is None:
            return False
        pos = self.pos[:, : self.n_slots]
        live = pos >= 0
        if self.window is not None:  # a later query at position p >= lengths sees p - window < k
            live = live & (pos > self.lengths[:, None] - self.window - self.spare)
        n_live = int(live.sum(axis=1).max().item())
        if self.n_slots - n_live < max(self.n_slots // 4, 1):
            return False
        slot = mx.arange(self.n_slots, dtype=mx.int32)[None]
        order = mx.argsort(mx.where(live, slot, slot + self.n_slots), axis=1)[:, :n_live]
        take = order[:, None, :, None]
        n = self.n_slots
        self.keys, self.values = (each(lambda a: mx.take_along_axis(a[..., :n, :], take, axis=2), stored)
                                  for stored in (self.keys, self.values))
        self.pos = mx.where(mx.take_along_axis(live, order, axis=1), mx.take_along_axis(pos, order, axis=1), -1)
        self.n_slots = n_live
        return True

    # -- rows in and out -------------------------------------------------------------------

    def add_rows(self, rows: list[tuple]) -> None:
        """Append rows given as (keys [1, H, n, D], values, positions [1, n], length), each a
        single-row cache's stored rows oldest first (`CacheKind.rows`); with `quantized`, keys
        and values are (data, scales, biases) tuples."""
        for k, *_ in rows:
            if isinstance(k, tuple) != (self.quantized is not None):
                raise ValueError(f"a row with {'quantized' if isinstance(k, tuple) else 'full-precision'} K/V "
                                 f"cannot join a batch of {'quantized' if self.quantized else 'full-precision'} K/V")
        width = max([self.n_slots] + [parts(k)[0].shape[2] for k, *_ in rows])
        mine = []
        if self.batch_size and self.keys is not None:
            n = self.n_slots
            mine = [(each(lambda a: a[..., :n, :], self.keys), each(lambda a: a[..., :n, :], self.values),
                     self.pos[:, :n], 0)]
        keys, values, pos = [], [], []
        for k, v, p, _ in mine + rows:
            pad = width - parts(k)[0].shape[2]
            if pad:
                k, v = (each(lambda a: mx.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]), x) for x in (k, v))
                p = mx.pad(p, [(0, 0), (0, pad)], constant_values=-1)
            keys.append(k), values.append(v), pos.append(p)
        self.keys, self.values = _concatenate(keys), _concatenate(values)
        self.pos = mx.concatenate(pos)
        self.lengths = mx.concatenate([self.lengths, mx.array([length for *_, length in rows], mx.int32)])
        self.n_slots = width

    def keep_rows(self, rows: list[int]) -> None:
        idx = mx.array(rows, mx.int32)
        if self.keys is not None:
            self.keys, self.values = each(lambda a: a[idx], self.keys), each(lambda a: a[idx], self.values)
        self.pos, self.lengths = self.pos[idx], self.lengths[idx]
        if not rows:
            self.keys = self.values = None
            self.n_slots = 0

    def row_cache(self, row: int, reserve: int):
        """Row `row` as a single-row engine cache (`KVCache`, `WindowKVCache` for a window,
        `QuantizedKVCache` for quantized K/V)."""
        pos = self.pos[row, : self.n_slots]
        n = int((pos >= 0).sum().item())
        order = mx.argsort(mx.where(pos >= 0, pos, pos.max() + 1 + mx.arange(self.n_slots)))[:n]
        k, v = (each(lambda a: a[row : row + 1, :, order], x) for x in (self.keys, self.values))
        mx.eval(parts(k), parts(v))  # gathered now: a lazy gather would keep the whole batch's buffers alive
        if self.quantized is not None:
            out = QuantizedKVCache(*self.quantized)
        else:
            out = KVCache() if self.window is None else WindowKVCache(self.window, reserve)
        out.keys, out.values, out.offset = k, v, int(self.lengths[row].item())
        if self.window is not None:
            out.n_stored = n
        return out

    # -- the rest of the cache protocol ----------------------------------------------------

    def is_trimmable(self) -> bool:
        return False  # rows roll back by `commit`, never all by one count

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.pos, self.lengths

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in parts(self.keys) + parts(self.values))


def parts(stored) -> tuple:
    """A layer's stored keys (or values) as a tuple of arrays: one float array, or mlx-lm's
    quantized (data, scales, biases)."""
    return stored if isinstance(stored, tuple) else (stored,)


def each(f, stored):
    """`f` applied to every array of `stored`, in its own form (an array or a tuple)."""
    return tuple(f(a) for a in stored) if isinstance(stored, tuple) else f(stored)


def _concatenate(rows: list):
    """Rows' keys (or values) stacked along the batch axis, part by part."""
    if not isinstance(rows[0], tuple):
        return mx.concatenate(rows)
    return tuple(mx.concatenate([r[i] for r in rows]) for i in range(len(rows[0])))
