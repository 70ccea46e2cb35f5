"""Caller-owned prompt caches: the target's caches, the drafter's context and the ids they cover.

Chat clients resend the whole conversation every turn. `stream_generate(..., prompt_cache=pc)`
starts from the longest prefix of the prompt that `pc` reaches exactly, prefills only the rest,
and leaves `pc` covering the prompt and the reply, ready for the next turn.

Reaching a shorter prefix than the cache holds, per cache kind:

* KV caches (plain or quantized): trimmed, always exact.
* Sliding-window caches (the target's `WindowKVCache` layers, the drafter's sliding context):
  trimmed while the rows they keep cover the cut (`reserve` rows past the window).
* Recurrent state (GatedDeltaNet, Mamba): never trimmed. For these and deep window cuts the
  cache keeps a *mark*: a snapshot one token before the end of the last prompt, the point that
  the next turn of a chat, or the same prompt again, shares.

A prefix reached neither way is refused: the cache starts cold and `last_reuse` says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .cache_kinds import cache_nbytes, can_trim, clone, kind_of, restore, snapshot

DEFAULT_RESERVE = 64  # tokens a window cache can drop exactly past its window (and the widest verify)


@dataclass
class Reuse:
    """What `PromptCache.reuse` did: `n_cached` prompt tokens came from the cache."""

    n_cached: int
    n_common: int  # prompt tokens the cache shared, before the cut to what it can reach
    how: str  # "trim", "mark", "cold" or "empty"
    reason: str | None = None  # why a shared prefix could not be used, when it could not


@dataclass
class _Mark:
    n: int
    target: list
    context: tuple | None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """The state of one conversation on one (target, drafter) pair, reusable across calls.

    Args:
        target: the `Target` it caches.
        drafter: the bound drafter whose context it keeps, or None (plain decoding).
        reserve: the widest verify block it serves and the deepest exact window trim.
        kv_bits, kv_group_size: quantized full-attention KV (as `stream_generate`'s).
    """

    def __init__(self, target, drafter=None, reserve: int = DEFAULT_RESERVE, kv_bits: int | None = None,
                 kv_group_size: int | None = None):
        if reserve < 1:
            raise ConfigError(f"a prompt cache's reserve must be >= 1, got {reserve}")
        self.target, self.drafter, self.reserve, self.kv_bits = target, drafter, reserve, kv_bits
        # the group actually used, so `check` compares like with like
        self.kv_group_size = target.kv_group_size(kv_bits, kv_group_size) if kv_bits is not None else kv_group_size
        self.last_reuse: Reuse | None = None
        self.reset()

    def reset(self) -> None:
        """Forget everything: fresh caches covering no tokens."""
        self.target_cache = self.target.make_cache(reserve=self.reserve, kv_bits=self.kv_bits,
                                                   kv_group_size=self.kv_group_size)
        self.context = self.drafter.begin(self.reserve) if self.drafter is not None else None
        self.tokens: list[int] = []
        self.prompt_len = 0  # length of the last prompt it served
        self._mark: _Mark | None = None

    def clone(self) -> "PromptCache":
        """An independent copy: trimming or extending one leaves the other as it was."""
        other = PromptCache.__new__(PromptCache)
        other.__dict__.update(self.__dict__)
        other.target_cache = [clone(c) for c in self.target_cache]
        other.context = self.context.clone() if self.context is not None else None
        other.tokens = list(self.tokens)
        return other  # the mark's snapshots are shared: restoring one never writes into them

    def plain_copy(self) -> "PromptCache":
        """An independent copy for plain decoding: the target's caches alone, without the
        drafter's context (a plain mode then starts from the state a drafter's mode reached)."""
        other = self.clone()
        other.drafter, other.context = None, None
        if other._mark is not None:
            other._mark = _Mark(other._mark.n, other._mark.target, None)
        return other

    # -- ownership ------------------------------------------------------------------------

    def check(self, target, drafter, width: int, kv_bits: int | None, kv_group_size: int | None = None) -> None:
        """Fail unless this cache was made for this target, drafter, width and KV format."""
        if target is not self.target or drafter is not self.drafter:
            raise ConfigError("this prompt cache was made for another target/drafter pair; "
                              "make one per pair (PromptCache(target, drafter))")
        if width > self.reserve:
            raise ConfigError(f"block size {width} exceeds the prompt cache's reserve {self.reserve}")
        if kv_bits is not None and kv_bits != self.kv_bits:
            raise ConfigError(f"kv_bits {kv_bits} differs from the prompt cache's {self.kv_bits}")
        if kv_group_size is not None and kv_group_size != self.kv_group_size:
            raise ConfigError(f"kv_group_size {kv_group_size} differs from the prompt cache's {self.kv_group_size}")

    # -- reuse ------------------------------------------------------------------------------

    def reuse(self, ids: list[int], prompt_len: int | None = None) -> Reuse:
        """Bring the caches to the longest prefix of `ids` they reach exactly (at least one
        token is left to feed, for its logits); the result says how many tokens that is.
        `prompt_len`: the prompt's length when `ids` goes on past it (a reply continued)."""
        prompt_len = len(ids) if prompt_len is None else prompt_len
        n_common = common_prefix(self.tokens, ids)
        m = min(n_common, len(ids) - 1)
        if not self.tokens:
            return self._done(Reuse(0, 0, "empty"), prompt_len)
        if m > 0 and self._can_trim(len(self.tokens) - m):
            self._trim(len(self.tokens) - m)
            return self._done(Reuse(m, n_common, "trim"), prompt_len)
        if m > 0 and self._mark is not None and self._mark.n <= m:
            self._restore_mark()
            return self._done(Reuse(self._mark.n, n_common, "mark"), prompt_len)
        reason = None if m <= 0 else (f"the cache cannot drop {len(self.tokens) - m} tokens exactly "
                                      f"({self._blocker()}) and holds no snapshot at or before token {m}")
        self.reset()
        return self._done(Reuse(0, n_common, "cold", reason), prompt_len)

    def _done(self, reuse: Reuse, prompt_len: int) -> Reuse:
        if self._mark is not None and self._mark.n > reuse.n_cached:
            self._mark = None  # it covers tokens the caches no longer share
        self.tokens = self.tokens[: reuse.n_cached]
        self.last_reuse, self.prompt_len = reuse, prompt_len
        return reuse

    def _can_trim(self, n: int) -> bool:
        ok = all(can_trim(c, n) for c in self.target_cache)
        return ok and (self.context is None or self.context.can_trim(n))

    def _blocker(self) -> str:
        kinds = {type(c).__name__ for c in self.target_cache if kind_of(c).needs_mark}
        if self.context is not None:
            kinds.add("the drafter's sliding context")
        return ", ".join(sorted(kinds)) or "unknown"

    def _trim(self, n: int) -> None:
        for c in self.target_cache:
            kind_of(c).trim(c, n)
        if self.context is not None:
            self.context.trim(n)

    # -- the mark ------------------------------------------------------------------------------

    @property
    def needs_mark(self) -> bool:
        """Whether some cache cannot be trimmed arbitrarily deep (so `take_mark` pays)."""
        caches = self.target_cache + (self.context.cache if self.context is not None else [])
        return any(kind_of(c).needs_mark for c in caches)

    def take_mark(self, n_tokens: int) -> None:
        """Snapshot the caches now, while they cover `n_tokens` tokens (the engine calls this
        one token before the end of each prompt)."""
        self._mark = _Mark(n_tokens, [snapshot(c) for c in self.target_cache],
                           self.context.snapshot() if self.context is not None else None)

    def _restore_mark(self) -> None:
        for c, snap in zip(self.target_cache, self._mark.target):
            restore(c, snap)
        if self.context is not None:
            self.context.restore(self._mark.context)

    # -- size -----------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes held: caches, the drafter's context and what the mark alone keeps alive (its
        window copies, and recurrent states and pending rows the live caches moved past)."""
        live = {id(a) for c in self.target_cache for a in kind_of(c).live_arrays(c)}
        n = sum(cache_nbytes(c) for c in self.target_cache)
        if self.context is not None:
            n += self.context.nbytes
            live |= {id(h) for h in self.context.pending}
        if self._mark is not None:
            n += sum(kind_of(c).snapshot_nbytes(s, live) for c, s in zip(self.target_cache, self._mark.target))
            if self._mark.context:
                caches, pending, _ = self._mark.context
                n += sum(kind_of(c).snapshot_nbytes(s, live) for c, s in zip(self.context.cache, caches))
                n += sum(h.nbytes for h in pending if id(h) not in live)
        return n


# -- on disk ----------------------------------------------------------------------------------

FORMAT = "dflash2-prompt-cache/1"


def save_prompt_cache(path, cache: PromptCache) -> None:
    """Write `cache` to a `.safetensors` file (mlx-lm's `save_prompt_cache` convention: arrays
    plus string metadata). The mark is not kept: a loaded cache trims what trims exactly, and
    recurrent state only grows from where it was saved."""
    import json

    import mlx.core as mx

    from ..paths import atomic_path

    arrays, layers = {}, []
    for i, c in enumerate(cache.target_cache):
        layers.append(_pack(f"target.{i}", c, arrays))
    context = None
    if cache.context is not None:
        ctx = cache.context
        context = {"layers": [_pack(f"context.{i}", c, arrays) for i, c in enumerate(ctx.cache)],
                   "n_tokens": ctx.n_tokens, "n_pending": len(ctx.pending)}
        arrays.update({f"pending.{j}": h for j, h in enumerate(ctx.pending)})
    meta = {"format": FORMAT, "tokens": cache.tokens, "prompt_len": cache.prompt_len, "reserve": cache.reserve,
            "kv_bits": cache.kv_bits, "kv_group_size": cache.kv_group_size, "target": cache.target.path,
            "layers": layers, "context": context,
            "drafter": getattr(cache.drafter, "path", None) if cache.drafter is not None else None}
    with atomic_path(path) as tmp:
        mx.save_safetensors(str(tmp), arrays, {"dflash2": json.dumps(meta)})


def load_prompt_cache(path, target, drafter=None) -> PromptCache:
    """A `PromptCache` read back from `save_prompt_cache`'s file; a ConfigError names what does
    not match (another target or drafter, another cache layout)."""
    import json

    import mlx.core as mx

    try:
        arrays, info = mx.load(str(path), return_metadata=True)
        meta = json.loads(info["dflash2"])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(f"{path} is not a dflash2 prompt cache: {e}") from e
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has prompt cache format {meta.get('format')!r}, this version reads {FORMAT!r}")
    drafter_path = getattr(drafter, "path", None) if drafter is not None else None
    if meta["target"] != target.path or meta["drafter"] != drafter_path:
        raise ConfigError(f"{path} caches target {meta['target']} with drafter {meta['drafter']}, not "
                          f"{target.path} with {drafter_path}")
    cache = PromptCache(target, drafter, reserve=meta["reserve"], kv_bits=meta["kv_bits"],
                        kv_group_size=meta.get("kv_group_size"))
    _unpack_all(path, "target", cache.target_cache, meta["layers"], arrays)
    if drafter is not None:
        ctx = meta["context"]
        _unpack_all(path, "context", cache.context.cache, ctx["layers"], arrays)
        cache.context.pending = [arrays[f"pending.{j}"] for j in range(ctx["n_pending"])]
        cache.context.n_tokens = ctx["n_tokens"]
    cache.tokens, cache.prompt_len = list(meta["tokens"]), meta["prompt_len"]
    return cache


def _pack(prefix: str, c, arrays: dict) -> dict:
    """Layer `c`'s scalars (returned) and arrays (into `arrays`, under `prefix`)."""
    meta, parts = kind_of(c).pack(c)
    arrays.update({f"{prefix}.{j}": a for j, a in enumerate(parts) if a is not None})
    return meta


def _unpack_all(path, prefix: str, caches: list, layers: list[dict], arrays: dict) -> None:
    kinds = [type(c).__name__ for c in caches]
    if kinds != [layer["kind"] for layer in layers]:
        raise ConfigError(f"{path} holds caches {[layer['kind'] for layer in layers]}, this pair makes {kinds}")
    for i, (c, layer) in enumerate(zip(caches, layers)):
        n_parts = layer.get("parts", layer.get("n", 0))
        kind_of(c).unpack(c, layer, [arrays.get(f"{prefix}.{i}.{j}") for j in range(n_parts)])
