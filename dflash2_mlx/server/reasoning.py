"""Reasoning split out of the reply, for models whose chat template has a thinking mode.

The tokenizer (mlx-lm's wrapper) knows the model's thinking markers (`think_start` /
`think_end`, e.g. `<think>` / `</think>`). Text between them is reasoning: it goes to each API's
own channel (OpenAI chat `reasoning_content`, Anthropic `thinking` blocks, Ollama `thinking`,
Responses `reasoning` items) and never into the content, where tool calls are parsed. Templates
that open the thinking block in the prompt itself (Qwen3.5 and later) leave the reply starting
inside it, which the split reads from the prompt's tokens. Decoding is not touched: speculation
runs inside the thinking span as anywhere else.
"""

from __future__ import annotations

REASONING, CONTENT = "reasoning", "content"


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    stream holds back in case the marker completes in the next piece."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _last(tokens: list[int], pattern) -> int:
    """Index of the last occurrence of the token sequence `pattern` in `tokens`, or -1."""
    n = len(pattern or ())
    if not n:
        return -1
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == tuple(pattern):
            return i
    return -1


class ReasoningSplit:
    """Feed the reply's text; get back, in order, (`REASONING` | `CONTENT`, text) pieces."""

    def __init__(self, start: str, end: str, inside: bool):
        self.start, self.end, self.inside = start, end, inside
        self.pending = ""

    @classmethod
    def for_prompt(cls, tokenizer, prompt_ids: list[int]) -> "ReasoningSplit | None":
        """The split for a reply to `prompt_ids`, or None when the model has no thinking mode."""
        if not getattr(tokenizer, "has_thinking", False) or not tokenizer.think_start or not tokenizer.think_end:
            return None
        opened = _last(prompt_ids, tokenizer.think_start_tokens)
        closed = _last(prompt_ids, tokenizer.think_end_tokens)
        return cls(tokenizer.think_start, tokenizer.think_end, opened > closed)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            marker = self.end if self.inside else self.start
            at = self.pending.find(marker)
            if at < 0:
                keep = partial_marker(self.pending, marker)
                self._emit(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            self._emit(out, self.pending[:at])
            self.pending, self.inside = self.pending[at + len(marker) :], not self.inside

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, self.pending)
        self.pending = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if text:
            out.append((REASONING if self.inside else CONTENT, text))


def split_all(split: "ReasoningSplit | None", text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    if split is None:
        return "", text
    pieces = split.feed(text) + split.finish()
    return ("".join(t for k, t in pieces if k == REASONING), "".join(t for k, t in pieces if k == CONTENT))


def pieces(split: "ReasoningSplit | None", text: str, final: bool = False) -> list[tuple[str, str]]:
    """The pieces of one streamed text (all content when the model does not think); `final`
    also flushes what the split held back."""
    if split is None:
        return [(CONTENT, text)] if text else []
    return split.feed(text) + (split.finish() if final else [])


def thinking_constraint(tokenizer, prompt_ids: list[int], vocab_size: int, budget: int | None, n_max: int,
                        then=None):
    """The constraint for a reply to `prompt_ids`: `then` (a grammar, or None), wrapped in a
    `ThinkingBudget` where the reply may think and needs one: a `budget` that can bind (below
    `n_max`), or a grammar for a reply that starts inside its thinking span, which must wait
    until the span closes. Otherwise `then` itself, so unconstrained decoding keeps its fast path."""
    from ..core.thinking_budget import ThinkingBudget

    split = ReasoningSplit.for_prompt(tokenizer, prompt_ids)
    if split is None:
        return then
    binding = budget is not None and budget < n_max
    if not binding and not (then is not None and split.inside):
        return then
    return ThinkingBudget(list(tokenizer.think_start_tokens), list(tokenizer.think_end_tokens), vocab_size,
                          budget if binding else None, split.inside, then)
