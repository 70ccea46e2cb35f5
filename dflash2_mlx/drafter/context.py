"""The drafter's context: what it knows of the committed sequence, owned by the drafter side.

Lifecycle (llama.cpp's `common/speculative.h` is the model):

    context = drafter.begin()            # empty, or a `PromptCache`'s context
    context.feed(states)                 # tapped target states of committed tokens [1, S, taps*H]
    proposal = drafter.draft(anchor, context, width, ...)   # reads the pending states
    context.feed(states[:, : n_accepted + 1])               # the verify pass's kept rows

`cache` holds the K/V of the states a draft has already read; `pending` holds states fed
since. Both cover the committed tokens in order, so `n_tokens` = cached + pending rows. The
engine never touches the caches' offsets: capping the context of an all-sliding drafter and
trimming it back for a prompt cache happen here.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..core.cache_kinds import cache_nbytes, can_trim, clone, restore, snapshot
from ..core.caches import WindowKVCache

MAX_PENDING_PARTS = 32  # long plain stretches feed one row at a time: keep the list short
# Pending rows may grow to this many times the limit before the unseen ones are dropped, so a
# long plain stretch past the window copies them once per `limit` steps, not at every step.
CAP_SLACK = 2


class DraftContext:
    """Context K/V caches plus the committed target states not yet read by a draft."""

    def __init__(self, cache: list, limit: int | None):
        self.cache = cache
        self.limit = limit  # the most context rows any draft query can see (None = unbounded)
        self.pending: list[mx.array] = []
        self.n_tokens = 0

    @property
    def n_pending(self) -> int:
        return sum(h.shape[1] for h in self.pending)

    def feed(self, states: mx.array) -> None:
        """Append the tapped target states [1, S, taps*H] of S newly committed tokens."""
        self.pending.append(states)
        self.n_tokens += states.shape[1]
        if len(self.pending) > MAX_PENDING_PARTS:
            self.pending = [mx.concatenate(self.pending, axis=1)]
        if self.limit is not None and self.n_pending > CAP_SLACK * self.limit:
            self._cap()

    def take(self) -> mx.array:
        """The pending states, handed to a draft that appends them to `cache` (so emptied here)."""
        if not self.pending:
            raise RuntimeError("a draft needs at least one committed state (feed the prompt first)")
        self._cap()
        ctx = mx.concatenate(self.pending, axis=1) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        return ctx

    def _cap(self) -> None:
        # Rows no draft query can ever see are dropped; the caches move to their absolute position.
        if self.limit is None:
            return
        n = self.n_pending
        if n > self.limit:
            ctx = mx.concatenate(self.pending, axis=1)
            self.pending = [mx.contiguous(ctx[:, n - self.limit :])]  # not a view holding all of ctx
            for c in self.cache:
                c.n_stored, c.offset = 0, c.offset + n - self.limit

    @property
    def nbytes(self) -> int:
        return sum(cache_nbytes(c) for c in self.cache) + sum(h.nbytes for h in self.pending)

    # -- rollback (for prompt caches) ---------------------------------------------------------

    def can_trim(self, n: int) -> bool:
        """Whether the last `n` tokens can be dropped exactly."""
        k = n - self.n_pending
        return all(can_trim(c, k) for c in self.cache)

    def trim(self, n: int) -> None:
        """Drop the last `n` tokens (check `can_trim` first)."""
        if not self.can_trim(n):
            raise ValueError(f"cannot drop {n} tokens of this draft context")
        keep = self.n_pending - n
        if keep >= 0:
            self.pending = [mx.contiguous(mx.concatenate(self.pending, axis=1)[:, :keep])] if keep else []
        else:
            self.pending = []
            for c in self.cache:
                c.trim(-keep)
        self.n_tokens -= n

    def clone(self) -> "DraftContext":
        """An independent copy (see `cache_kinds.clone`)."""
        other = DraftContext([clone(c) for c in self.cache], self.limit)
        other.pending, other.n_tokens = list(self.pending), self.n_tokens
        return other

    def snapshot(self) -> tuple:
        """What `restore` needs to come back to this state (window rows are copied: they are
        written in place later)."""
        # pending rows are often views of a whole pass's states: copy them, or they keep it alive
        pending = [mx.contiguous(h) for h in self.pending]
        mx.eval(pending)
        return [snapshot(c) for c in self.cache], pending, self.n_tokens

    def restore(self, snap: tuple) -> None:
        caches, pending, self.n_tokens = snap
        for c, state in zip(self.cache, caches):
            restore(c, state)
        self.pending = list(pending)


def draft_caches(config, reserve: int = 0) -> list:
    """One context K/V store per drafter layer; sliding layers keep `sliding_window - 1 + reserve` rows."""
    return [WindowKVCache(config.sliding_window, reserve) if t == "sliding_attention" else KVCache()
            for t in config.layer_types]
