"""Where a reply ends: EOS, stop strings and max_tokens, and the text handed out so far.

One `Stopper` per reply, fed the emitted tokens of each cycle (the single-stream engine and
the batch alike); a tail that could still become a stop string is held back. Control tokens
(`<|im_start|>`, `<|fim_pad|>`, …) stay out of the text, as in vLLM and llama.cpp.
"""

from __future__ import annotations

_MARKERS = ("tool_call_start", "tool_call_end", "think_start", "think_end")


def unrendered_tokens(tokenizer) -> dict[int, str]:
    """{id: text} of the special added tokens a reply's text leaves out; the tool-call and
    thinking markers stay, since the server parses them from that text."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    markers = {getattr(tokenizer, name, None) for name in _MARKERS}
    return {i: t.content for i, t in added.items() if getattr(t, "special", False) and t.content not in markers}


def find_stop(text: str, stop: list[str], start: int) -> tuple[int, str | None]:
    """Earliest (index, stop string) of a stop string in `text` that ends after `start`, or (-1, None)."""
    hits = [(text.find(s, max(0, start - len(s) + 1)), s) for s in stop]
    return min(((i, s) for i, s in hits if i >= 0), default=(-1, None), key=lambda hit: hit[0])


class Stopper:
    """Cuts the emitted stream at EOS, stop strings and max_tokens; builds the text."""

    def __init__(self, tokenizer, eos: set[int], stop: list[str], max_tokens: int):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos, self.stop, self.max_tokens = eos, [s for s in stop if s], max_tokens
        self.unrendered = unrendered_tokens(tokenizer)
        self.text, self.tokens, self.sent, self.searched = "", [], 0, 0
        self.matched: str | None = None

    def feed(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Accept tokens; return (kept tokens, finish reason or None)."""
        kept = []
        for t in tokens:
            if t in self.eos:
                return kept, "stop"
            self.tokens.append(t)
            kept.append(t)
            hidden = self.unrendered.get(t)
            if hidden is not None:
                if hidden in self.stop:  # a stop string spelled as the control token itself
                    self.matched = hidden
                    return kept, "stop"
            else:
                self.detok.add_token(t)
                self.text += self.detok.last_segment
                if self.stop and self._hit_stop():
                    return kept, "stop"
            if len(self.tokens) >= self.max_tokens:
                return kept, "length"
        return kept, None

    def _hit_stop(self) -> bool:
        # The text before `searched` held no match, so only one ending after it can be new.
        cut, matched = find_stop(self.text, self.stop, self.searched)
        self.searched = len(self.text)
        if cut >= 0:
            self.matched = matched
            self.text = self.text[:cut]
            return True
        return False

    def new_text(self, final: bool) -> str:
        if final:
            self.detok.finalize()
            # A reply cut mid-character (max_tokens) leaves incomplete UTF-8, which finalize
            # decodes as U+FFFD; those bytes are never a character, so they are dropped.
            self.text += self.detok.last_segment.rstrip("\ufffd")
            self._hit_stop()
        # Hold back a tail that could still become a stop string.
        hold = 0 if final else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out
