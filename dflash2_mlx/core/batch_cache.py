"""A whole model's batched caches: one batched layer per layer of the target, rows by index.

K/V layers batch as `RaggedKVCache`s (`ragged.py`: each row rolls back by its own count) and
recurrent layers as one `RecurrentCache` holding every row's state (`commit_rows` replays each
row's kept prefix). What a layer does is its kind's (`cache_kinds.py`); these functions walk the
layers.
"""

from __future__ import annotations

from ..errors import UnsupportedCacheError
from .cache_kinds import kind_of


def empty_batch(target, kv_bits: int | None = None, kv_group_size: int | None = None) -> list:
    """Batched caches with no rows, one per layer of `target` (kinds as `Target.make_cache`;
    `kv_bits` quantizes the K/V layers as it does)."""
    out = []
    for i, c in enumerate(target.make_cache(reserve=1, kv_bits=kv_bits, kv_group_size=kv_group_size)):
        try:
            out.append(kind_of(c).empty_batch(c))
        except UnsupportedCacheError as e:
            raise UnsupportedCacheError(f"layer {i}: {e}") from None
    return out


def batch_size(cache: list) -> int:
    """Rows in the batch (0 when none)."""
    sizes = (kind_of(c).batch_size(c) for c in cache)
    return next((n for n in sizes if n is not None), 0)


def add_rows(cache: list, rows: list[list]) -> None:
    """Append rows given as single-row engine caches (each a list, one cache per layer)."""
    for i, c in enumerate(cache):
        try:
            kind_of(c).add_rows(c, [r[i] for r in rows])
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None


def keep_rows(cache: list, rows: list[int]) -> None:
    """Keep only the rows at `rows` (in that order)."""
    for c in cache:
        kind_of(c).keep_rows(c, rows)


def row_cache(cache: list, row: int, reserve: int) -> list:
    """Row `row` as single-row engine caches, one per layer (what `Target.make_cache` makes)."""
    return [kind_of(c).row_cache(c, row, reserve) for c in cache]


def compact(cache: list) -> None:
    """Pack away the slots no row uses any more (see `RaggedKVCache.compact`)."""
    for c in cache:
        kind_of(c).compact(c)
