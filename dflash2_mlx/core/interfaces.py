"""The interfaces between the decoding layers, declared: what the engines ask of a target, a
drafter, a width policy and a decoding constraint. `Target`, `Drafter` and the policies in `block_policy` implement
them; test doubles (a scripted drafter) implement the same, checked by `isinstance` in tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

    from ..drafter.config import DrafterConfig
    from ..drafter.context import DraftContext
    from ..drafter.selector import Proposal


@runtime_checkable
class TargetModel(Protocol):
    """The model being decoded: its caches, one forward pass with hidden-state taps, and the
    rollback of a verify pass (`arm` before it, `commit` / `commit_rows` after)."""

    tokenizer: object
    info: object  # `TargetInfo`: vocab size, layers, what the drafter shares

    @property
    def eos_token_ids(self) -> set[int]: ...

    @property
    def pipelined(self) -> bool: ...  # one stage of a pipeline over processes (`distributed.py`)

    def make_cache(self, reserve: int = 16, kv_bits: int | None = None,
                   kv_group_size: int | None = None) -> list: ...

    def forward(self, tokens: mx.array, cache: list, taps: tuple[int, ...] = (),
                logits: str = "all") -> tuple[mx.array | None, mx.array | None]: ...

    def arm(self, cache: list) -> None: ...

    def commit(self, cache: list, n_fed: int, n_keep: int) -> None: ...

    def commit_rows(self, cache: list, n_fed: int, n_keep: list[int]) -> None: ...


@runtime_checkable
class DraftModel(Protocol):
    """A drafter bound to its target: it owns its context (`begin`) and drafts a block after an
    anchor from it."""

    config: DrafterConfig
    target: TargetModel

    def begin(self, reserve: int = 0) -> DraftContext: ...

    def draft(self, anchor: mx.array, context: DraftContext, block_size: int, temperature: float = 0.0,
              key: mx.array | None = None) -> Proposal: ...


@runtime_checkable
class WidthPolicy(Protocol):
    """Chooses each single-stream cycle's verify width (1: a plain step) and learns from it."""

    def begin(self) -> None: ...  # a new reply starts (its text is new evidence)

    def next_width(self, max_width: int) -> int: ...

    def observe(self, cycle) -> None: ...  # an engine.CycleStats


@runtime_checkable
class BatchPolicy(Protocol):
    """Chooses a batch cycle's width from the batch size, and learns from every row's cycle."""

    def begin(self) -> None: ...  # a new reply joins the batch

    def next_width(self, max_width: int, batch: int) -> int: ...

    def observe(self, batch: int, cycle, rows: list[tuple[int, int]]) -> None: ...  # cycle: a CycleStats


@runtime_checkable
class Constraint(Protocol):
    """Masks the target's rows along a draft path (`GrammarConstraint`, `ThinkingBudget`): row 0
    in the state after the emitted tokens, row i+1 after drafts[0..i]; `consume` the tokens a cycle emits."""

    mask_drafts: bool  # greedy: forbidden drafts are repaired before the verify (`walk`)

    def walk(self, drafts: list[int], candidates=None) -> tuple[list[int], np.ndarray]: ...

    def masks(self, drafts: list[int]) -> np.ndarray: ...

    def apply(self, rows: mx.array, drafts: list[int], allowed: np.ndarray | None = None) -> mx.array: ...

    def consume(self, tokens: list[int]) -> None: ...

    @property
    def done(self) -> bool: ...
