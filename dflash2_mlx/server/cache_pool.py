"""The server's prefix cache: an LRU of `PromptCache`s keyed by token prefix, bounded in bytes.

A request checks out the entry sharing the longest prefix with its prompt (or a fresh cache),
generates with it, and checks it back in, now covering its prompt and reply, as the most
recently used. A request that goes on from the entry's last prompt (the next turn of that
chat, or the same prompt again) takes the entry; one that shares less (another chat with the
same system prompt) takes a copy, so the entry stays for its own conversation. Entries are
evicted least recently used first until the total fits `max_bytes`. Only the generation worker
thread calls in; `snapshot` may be read from any thread.
One pool serves one (target, drafter) pair, so an entry is never used for another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..core.prompt_cache import PromptCache, common_prefix
from .config import DEFAULT_PROMPT_CACHE_BYTES


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    cached_tokens: int = 0
    bytes: int = 0
    entries: int = 0


class PromptCachePool:
    """Args: `make` builds an empty `PromptCache` for the server's pair; `max_bytes` bounds the
    bytes the pool holds between requests (0 disables caching: `checkout` returns None)."""

    def __init__(self, make: Callable[[], PromptCache], max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.make, self.max_bytes = make, max_bytes
        self._entries: OrderedDict[int, PromptCache] = OrderedDict()  # id -> cache, oldest first
        self._lock = threading.Lock()
        self.stats = PoolStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def _best(self, ids: list[int]):
        best, best_n = None, 0
        for key, cache in self._entries.items():
            n = common_prefix(cache.tokens, ids)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def checkout(self, ids: list[int]) -> PromptCache | None:
        """The entry sharing the longest prefix with `ids`, taken out of the pool or copied
        (see the module docstring); a fresh cache when none shares a token; None when off."""
        if not self.enabled:
            return None
        with self._lock:
            best, best_n = self._best(ids)
            if best is None:
                return self.make()
            if best_n < self._entries[best].prompt_len - 1:
                self._entries.move_to_end(best)  # it served a request: recently used
                return self._entries[best].clone()
            cache = self._entries.pop(best)
            self._update_size()
            return cache

    def checkin(self, cache: PromptCache | None) -> None:
        """Return a cache after its request, as the most recent entry; evict to fit."""
        if cache is None:
            return
        reuse = cache.last_reuse
        with self._lock:
            if reuse is not None and reuse.n_cached > 0:
                self.stats.hits += 1
                self.stats.cached_tokens += reuse.n_cached
            else:
                self.stats.misses += 1
            if cache.tokens:
                self._entries[id(cache)] = cache
            while self._entries and self._total() > self.max_bytes:
                self._entries.popitem(last=False)
                self.stats.evictions += 1
            self._update_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._update_size()

    def snapshot(self) -> PoolStats:
        with self._lock:
            return PoolStats(**vars(self.stats))

    def _total(self) -> int:
        return sum(c.nbytes for c in self._entries.values())

    def _update_size(self) -> None:
        self.stats.bytes, self.stats.entries = self._total(), len(self._entries)
