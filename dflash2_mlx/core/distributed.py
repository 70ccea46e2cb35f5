"""Speculation over a target sharded across processes (`mlx.launch`, any MLX backend).

Every rank holds a tensor-parallel shard of the target (mlx-lm's `Model.shard`), or one stage
of a pipeline (`pipeline(group)`, where mlx-lm has it: rank 0 the last layers), and runs the
same decoding loop in lockstep; rank 0 alone holds the drafter and is authoritative: it drafts,
decides acceptance and samples, and each cycle shares the drafts and then (accepted count, next
token) with the others as small int arrays (an `all_sum` in which only rank 0 contributes). The
verify pass itself is collective (the shards' all-reduces), so every rank's caches see the same
tokens, and each rolls its own back (recurrent layers included) by the shared count. Pipelined,
the drafter's taps live on the stages that hold their layers: every pass sums them to every rank
(`Target.pipeline_taps`, agreed once with `agree_taps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import ConfigError

SHARD_MODES = ("tensor", "pipeline")


@dataclass
class Lockstep:
    """This process's place in a launched group, and the one collective the decoder adds."""

    group: object  # mx.distributed.Group
    mode: str = "tensor"  # or "pipeline"

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, x: mx.array) -> mx.array:
        """Rank 0's `x` on every rank (int32; the others' values are ignored). The others send
        `x * 0`, not fresh zeros, so that they evaluate `x`'s graph, and so every collective in
        it, exactly as rank 0 does: ranks must run the same collectives in the same order."""
        x = x.astype(mx.int32)
        return mx.distributed.all_sum(x if self.leader else x * 0, group=self.group)

    def describe(self) -> dict:
        return {"size": self.size, "rank": self.rank, "backend": backend_name(), "mode": self.mode}


def backend_name() -> str:
    """The backend `mlx.launch` set up, read from the variables it exports for each."""
    import os

    if os.environ.get("MLX_JACCL_COORDINATOR") or os.environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return "mpi"
    if os.environ.get("MLX_HOSTFILE"):
        return "ring"
    return "unknown"


def launched(mode: str = "tensor") -> Lockstep | None:
    """The group this process was launched into by `mlx.launch` (sharded the way `mode` says),
    or None when it runs alone."""
    check_shard_mode(mode)
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return Lockstep(group, mode) if group.size() > 1 else None


def check_shardable(args, size: int) -> None:
    """Refuse a group size the attention heads cannot be split over (mlx-lm's `shard` divides
    them without checking, and the first forward pass then fails on mismatched shapes)."""
    cfg = getattr(args, "text_config", None) or {}
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) and cfg else (lambda k: getattr(args, k, None))
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    for name, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if isinstance(n, int) and n % size:
            raise ConfigError(f"cannot shard this model over {size} ranks: its {n} {name} do not divide by {size} "
                              f"({heads} attention heads, {kv_heads} KV heads)")


def shard_model(model, lockstep: Lockstep) -> None:
    """Tensor-parallel shards of `model`'s decoder layers over the group (mlx-lm's own `shard`).
    The output head stays whole on every rank: the drafter shares it, and rank 0 reads every
    row's full logits (mlx-lm shards some heads by vocabulary and gathers them in its own call)."""
    if not hasattr(model, "shard"):
        raise ConfigError(f"mlx-lm cannot shard a {getattr(model, 'model_type', type(model).__name__)} model "
                          "(no Model.shard); run it on one machine")
    check_shardable(getattr(model, "args", None), lockstep.size)
    owners = [m for m in (model, getattr(model, "language_model", None)) if m is not None and "lm_head" in m]
    heads = [(m, m.lm_head) for m in owners]
    try:
        model.shard(lockstep.group)
    except AssertionError as e:  # mlx-lm asserts what it cannot split (heads, vocabulary)
        raise ConfigError(f"cannot shard this model over {lockstep.size} ranks: {e}") from None
    for owner, head in heads:
        owner.lm_head = head
        if hasattr(owner, "sharding_group"):
            owner.sharding_group = None
    mx.eval(model.parameters())


def check_shard_mode(mode: str) -> None:
    if mode not in SHARD_MODES:
        raise ConfigError(f"--shard must be one of {', '.join(SHARD_MODES)}, got {mode!r}")


def split_model(model, lockstep: Lockstep) -> None:
    """Shard `model` over the group the way `lockstep.mode` says."""
    check_shard_mode(lockstep.mode)
    (shard_model if lockstep.mode == "tensor" else pipeline_model)(model, lockstep)


def pipeline_model(model, lockstep: Lockstep) -> None:
    """One pipeline stage of `model`'s decoder layers per rank (mlx-lm's own `pipeline`: rank 0
    the last layers, so it holds the head's input; embedding and head stay on every rank)."""
    text = getattr(model, "language_model", model)  # a multimodal wrapper holds its text model
    inner = getattr(text, "model", None)  # the decoder, where mlx-lm's PipelineMixin sits
    kind = getattr(model, "model_type", type(model).__name__)
    if not hasattr(inner, "pipeline"):
        raise ConfigError(f"mlx-lm cannot pipeline a {kind} model (no pipeline()); use --shard tensor")
    if len(inner.layers) < lockstep.size:
        raise ConfigError(f"cannot pipeline {len(inner.layers)} layers over {lockstep.size} ranks")
    inner.pipeline(lockstep.group)
    mx.eval(model.parameters())


def agree_taps(lockstep: Lockstep, target, taps: tuple[int, ...]) -> None:
    """Pipelined: every rank learns the taps rank 0's drafters read (`taps` on rank 0; the others'
    are ignored), so that every pass gathers them from the stages that hold them. Every rank
    calls this once, before decoding."""
    if not target.pipelined:
        return
    mine = list(taps) if lockstep.leader else []
    n = int(lockstep.share(mx.array([len(mine)])).item())
    ids = lockstep.share(mx.array(mine or [0] * n)).tolist() if n else []
    target.pipeline_taps = tuple(ids)


# -- serving: rank 0 takes the requests, the others decode each one with it ----------------

GENERATE, STOP = 1, 0


def announce(lockstep: Lockstep, ids: list[int]) -> None:
    """Rank 0, before decoding a request: its prompt ids to every rank (`follow_requests`)."""
    mx.eval(lockstep.share(mx.array([GENERATE, len(ids)])))  # evaluated now: collectives run in order
    mx.eval(lockstep.share(mx.array(ids)))


def announce_stop(lockstep: Lockstep) -> None:
    """Rank 0, at shutdown: the other ranks leave `follow_requests`."""
    mx.eval(lockstep.share(mx.array([STOP, 0])))


def follow_requests(session) -> int:
    """A rank other than 0 of a sharded `serve`: decode every request rank 0 announces, in
    lockstep (rank 0 decides each token, its width and limit, and when to stop), until it
    announces the stop; returns how many requests it followed."""
    import signal

    # a stop comes from rank 0 (it shuts down gracefully, then announces it): ignore the launcher's
    # signals here, or this rank would vanish while rank 0 still has a request to finish with it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    lockstep, n = session.lockstep, 0
    while True:
        op, n_ids = lockstep.share(mx.zeros((2,), mx.int32)).tolist()
        if op == STOP:
            return n
        ids = lockstep.share(mx.zeros((n_ids,), mx.int32)).tolist()
        for _ in session.stream(ids, max_tokens=1):  # rank 0's limit and width replace these
            pass
        n += 1
