"""How many requests may decode together: rows up to `--max-batch`, and K/V memory for all of them.

A fixed row count fits neither case: 32 short chats fit easily where four 32k-token agent
contexts do not. So the worker admits a request into the running set only while the tokens
every admitted request may reach (prompt + `max_tokens`) fit a K/V budget; a request that
does not fit waits (in arrival order) until others finish, and one alone is always admitted.

The budget (`--batch-memory`, default auto) is half of the device's memory (Metal's
recommended working set, else physical memory) less the weights and the prefix cache's
budget. Bytes per token of context are measured once on this pair: a short prompt through a
prompt cache at two lengths, so the difference is per token (K/V, the drafter's context) and
the rest per row (recurrent states).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx.utils import tree_flatten

from ..core.generate import stream_generate
from ..errors import ConfigError

MEMORY_SHARE = 0.5  # of the device's memory, for weights + prefix cache + the rows' K/V
PROBE_TOKENS = (64, 320)  # two prompt lengths a KV step (256) apart


@dataclass(frozen=True)
class KVCost:
    """Bytes a row holds: `per_row` whatever its length, plus `per_token` of context."""

    per_token: float
    per_row: float

    def row_bytes(self, n_tokens: int) -> float:
        return self.per_row + self.per_token * n_tokens


def weights_bytes(*modules) -> int:
    return sum(v.nbytes for m in modules if m is not None for _, v in tree_flatten(m.parameters()))


def measure_kv_cost(session) -> KVCost:
    """Per-token and per-row bytes of this pair's caches (target, drafter context)."""
    sizes = []
    for n in PROBE_TOKENS:
        cache = session.prompt_cache()
        ids = [(7 * i + 3) % max(session.target.info.vocab_size - 1, 2) + 1 for i in range(n)]
        for _ in stream_generate(session.target, ids, drafter=session.drafter, max_tokens=1, prompt_cache=cache):
            pass
        sizes.append(cache.nbytes)
    (n1, n2), (b1, b2) = PROBE_TOKENS, sizes
    per_token = max((b2 - b1) / (n2 - n1), 1.0)
    return KVCost(per_token, max(b1 - per_token * n1, 0.0))


def auto_budget(session, prompt_cache_bytes: int, memory: int | None = None) -> int:
    """`MEMORY_SHARE` of the device's memory less the weights and the prefix cache's budget."""
    if memory is None:
        from ..doctor import usable_memory

        memory = usable_memory()
    if not memory:
        raise ConfigError("this device does not report its memory: set --batch-memory")
    budget = int(MEMORY_SHARE * memory) - weights_bytes(session.target.model, session.drafter) - prompt_cache_bytes
    if budget <= 0:
        raise ConfigError(f"no memory left for decoding: {MEMORY_SHARE:.0%} of {memory / 2**30:.1f} GiB holds "
                          f"the weights and --prompt-cache-bytes {prompt_cache_bytes}; lower --prompt-cache-bytes "
                          "or set --batch-memory")
    return budget


class KVBudget:
    """Admission by the K/V bytes the admitted requests may reach (rows are `--max-batch`'s)."""

    def __init__(self, budget_bytes: int, cost: KVCost):
        if budget_bytes <= 0:
            raise ConfigError(f"--batch-memory must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes, self.cost = budget_bytes, cost
        self.held: dict[int, float] = {}  # id(job) -> bytes it may reach

    @property
    def held_bytes(self) -> float:
        return sum(self.held.values())

    def fits(self, n_tokens: int) -> bool:
        """Whether a request reaching `n_tokens` of context fits beside those held (always when
        none are: one request alone is never refused)."""
        return not self.held or self.held_bytes + self.cost.row_bytes(n_tokens) <= self.budget_bytes

    def hold(self, key: int, n_tokens: int) -> None:
        self.held[key] = self.cost.row_bytes(n_tokens)

    def release(self, key: int) -> None:
        self.held.pop(key, None)

    def describe(self) -> str:
        tokens = max(self.budget_bytes - self.cost.per_row, 0) / self.cost.per_token
        return (f"{self.budget_bytes / 2**30:.1f} GiB for the K/V of requests decoding together "
                f"({self.cost.per_token / 1024:.1f} KiB per token of context: {int(tokens):,} tokens in all)")
