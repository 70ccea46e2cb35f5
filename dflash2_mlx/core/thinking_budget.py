"""A cap on a reply's thinking span, and the grammar that starts after it, exact under speculation.

`ThinkingBudget` is a constraint (`interfaces.Constraint`) over token ids: while the reply is
inside its thinking span it allows every token until `budget` tokens are spent, then only the
next token of the end marker, so the span closes there (as Anthropic's `budget_tokens` and
vLLM's thinking budgets do). Once the span has closed, an optional inner constraint (a tool
call's or a JSON schema's grammar) takes over: a thinking model then thinks first and answers in
the grammar after, instead of being forced into the grammar while still inside its reasoning.

Like `GrammarConstraint` it masks each verify row by the state reached along the draft path, so
speculative output equals constrained plain decoding; under greedy decoding a draft it forbids is
replaced by the one token it allows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from .constraint import masked
from .interfaces import Constraint


@dataclass(frozen=True)
class _State:
    inside: bool  # within the thinking span
    spent: int = 0  # tokens written inside the span, end marker excluded
    start_seen: int = 0  # tokens of the start marker matched at the tail
    end_seen: int = 0  # tokens of the end marker matched at the tail
    closed: bool = False  # a span was opened and closed: the inner constraint rules from here


def _match(seen: int, marker: tuple[int, ...], token: int) -> int:
    """How many tokens of `marker` the tail matches after `token`, given `seen` before it."""
    if seen < len(marker) and token == marker[seen]:
        return seen + 1
    return 1 if marker and token == marker[0] else 0


class ThinkingBudget:
    """Masks along a draft path for a reply that may think; `commit` the tokens a step emits."""

    def __init__(self, start: list[int], end: list[int], vocab_size: int, budget: int | None, inside: bool,
                 then: Constraint | None = None):
        if not end:
            raise ValueError("a thinking budget needs the end marker's token ids, got none")
        if budget is not None and budget < 0:
            raise ValueError(f"the thinking budget must be >= 0 tokens, got {budget}")
        self.start, self.end = tuple(start), tuple(end)
        self.vocab_size, self.budget, self.then = vocab_size, budget, then
        self.state = _State(inside=inside)
        self.mask_drafts = True if then is None else then.mask_drafts
        self.forced = 0  # end-marker tokens the budget imposed

    def _hands_over(self, state: _State) -> bool:
        """Whether the inner constraint rules from `state` on (with no inner one: never)."""
        return self.then is not None and not state.inside

    def _forced(self, state: _State) -> int | None:
        """The one token allowed at `state`, or None when any is."""
        if not state.inside or self.budget is None:
            return None
        if state.spent >= self.budget:  # close now, or finish the end marker the budget started
            return self.end[state.end_seen]
        return None

    def _advance(self, state: _State, token: int) -> _State:
        if not state.inside:
            seen = _match(state.start_seen, self.start, token)
            if self.start and seen == len(self.start) and not state.closed:
                return _State(inside=True)
            return replace(state, start_seen=seen)
        seen = _match(state.end_seen, self.end, token)
        if seen == len(self.end):
            return _State(inside=False, closed=True)
        return replace(state, spent=state.spent + 1, end_seen=seen)

    def masks(self, drafts: list[int]) -> np.ndarray:
        """Allowed tokens [len(drafts) + 1, V] per verify row (all True past a forbidden draft)."""
        return self.walk(drafts, repair=False)[1]

    def walk(self, drafts: list[int], candidates=None, repair: bool = True) -> tuple[list[int], np.ndarray]:
        """(the drafts, allowed tokens per verify row) along the draft path; a draft the budget
        forbids is replaced by the token it forces (`repair`: greedy only, like the grammar's),
        and the inner constraint walks the rest of the path from where the span closed."""
        out = list(drafts)
        rows = np.ones((len(out) + 1, self.vocab_size), dtype=bool)
        state = self.state
        for i in range(len(out) + 1):
            if self._hands_over(state):
                rest = (lambda: candidates()[i:]) if candidates is not None else None
                tail, rows[i:] = self.then.walk(out[i:], rest) if repair else (out[i:], self.then.masks(out[i:]))
                out[i:] = tail
                break
            forced = self._forced(state)
            if forced is not None:
                rows[i] = False
                rows[i][forced] = True
            if i == len(out):
                break
            if forced is not None and out[i] != forced:
                if not repair:
                    break  # the verify rejects this draft; the rows after it are never used
                out[i] = forced
            state = self._advance(state, out[i])
        return out, rows

    def apply(self, rows: mx.array, drafts: list[int], allowed: np.ndarray | None = None) -> mx.array:
        """`rows [R, V]` with the tokens forbidden at each row set to -inf."""
        return masked(rows, self.masks(drafts) if allowed is None else allowed)

    def consume(self, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            if self._hands_over(self.state):
                self.then.consume(tokens[i:])
                return
            self.forced += self._forced(self.state) is not None
            self.state = self._advance(self.state, token)

    @property
    def done(self) -> bool:
        return self._hands_over(self.state) and self.then.done
