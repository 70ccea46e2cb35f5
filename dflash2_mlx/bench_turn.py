"""A turn after a prefix-cache hit, for `dflash2 bench --turn-tokens K`.

An agent resends its long context every turn and a server finds all but the newest tokens in
its prompt cache. So here each run starts from a cache holding the prompt's first len - K tokens
and prefills only the last K: prefill tok/s and TTFT measure the turn, decode runs at the full
context. The prefix is prefilled once per drafter, by our engine and untimed; every mode's run
gets its own copy of it. The reference mode gets the same target caches: mlx-lm's server reuses
a prompt cache the same way, and it spares mlx-lm's slow quantized long prefill on a CPU.
"""

from __future__ import annotations

from .core.cache_kinds import clone
from .core.generate import stream_generate
from .errors import ConfigError

PLAIN_KV_KINDS = ("KVCache", "QuantizedKVCache")  # mlx-lm's own, which its model call can extend


def check_turn(turn_tokens: int, prompt_lengths: list[int], target, modes, kv: dict) -> None:
    """Refuse a turn that leaves no cached prefix, or a reference mode this target's caches
    cannot be handed to, before anything is prefilled."""
    if turn_tokens < 1:
        raise ConfigError(f"--turn-tokens must be >= 1, got {turn_tokens}")
    shortest = min(prompt_lengths)
    if turn_tokens >= shortest:
        raise ConfigError(f"--turn-tokens {turn_tokens} leaves no cached prefix in a {shortest}-token prompt; "
                          f"use at most {shortest - 1}")
    if any(m.kind == "mlx_lm" for m in modes):
        kinds = sorted({type(c).__name__ for c in target.make_cache(**kv)} - set(PLAIN_KV_KINDS))
        if kinds:
            raise ConfigError(f"--turn-tokens with the mlx_lm mode hands mlx-lm our prefilled caches, which needs "
                              f"K/V caches in every layer; this target has {kinds}")


class TurnPrefix:
    """One prompt's first `n` tokens, prefilled once per drafter among `modes` (plain modes and
    the reference copy any one's target caches), and a fresh copy of it for each run."""

    def __init__(self, target, modes, ids: list[int], n: int, kv: dict):
        from .core.prompt_cache import DEFAULT_RESERVE, PromptCache

        drafters = {id(m.drafter): m.drafter for m in modes if m.drafter is not None} or {id(None): None}
        self.n = n
        self.caches = {}
        for key, drafter in drafters.items():
            reserve = max([DEFAULT_RESERVE] + [m.width() or 1 for m in modes if m.drafter is drafter])
            cache = PromptCache(target, drafter, reserve=reserve, **kv)
            for _ in stream_generate(target, ids[:n], drafter=drafter, max_tokens=1, prompt_cache=cache, **kv):
                pass
            reuse = cache.reuse(ids[: n + 1])  # drop the sampled token: the cache holds the prefix alone
            if reuse.n_cached != n:
                raise RuntimeError(f"the turn's prefix cache reached {reuse.n_cached} of {n} tokens: {reuse.reason}")
            self.caches[key] = cache

    def copy_for(self, mode):
        """The cache a run of `mode` starts from: ours a `PromptCache`, mlx-lm's a list."""
        if mode.drafter is not None:
            return self.caches[id(mode.drafter)].clone()
        base = next(iter(self.caches.values()))
        return [clone(c) for c in base.target_cache] if mode.kind == "mlx_lm" else base.plain_copy()

    @property
    def nbytes(self) -> int:
        """Bytes the kept prefixes hold (besides the copy a run extends)."""
        return sum(c.nbytes for c in self.caches.values())

