"""Grammar-constrained decoding that stays exact under speculation (llguidance).

A `GrammarConstraint` owns an llguidance matcher over the target's vocabulary. The engine asks
it for one mask per verify row: row 0 in the current grammar state, row i+1 in the state
reached by consuming drafts[0..i]; the walk stops at the first draft the grammar forbids
(that draft is rejected like any other mismatch, so the rows after it are never used). The
walk runs on a copy of the matcher; only the tokens the cycle emits are committed.

Masking the target's rows this way makes speculative output equal constrained plain decoding:
greedy picks the argmax over allowed tokens, and rejection sampling runs against the masked
target distribution, in which a forbidden draft has probability 0.

Under greedy decoding the drafts are also masked (`walk` with candidates, on by default): a draft the grammar
forbids would be rejected for sure, so it is replaced by the drafter's best allowed candidate
before the verify. Any draft is exact under greedy verification; sampled proposals are left
alone, since their q must describe the drafts the verify sees.
"""

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np

from ..errors import ConfigError


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:  # a declared dependency; say how to get it back
        raise ConfigError(f"grammar constraints need llguidance (pip install llguidance): {e}") from None
    return llguidance


_TOKENIZERS: dict = {}


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """The llguidance view of an mlx-lm tokenizer (built once per tokenizer: it scans the vocab)."""
    key = (id(tokenizer), vocab_size)
    if key not in _TOKENIZERS:
        ll = _llguidance()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        _TOKENIZERS[key] = (tokenizer, ll.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None))
    return _TOKENIZERS[key][1]


# Longest run of digits a JSON reply may write: JSON numbers are unbounded, and a weak model can
# write digits until its token limit (a 52-digit float was seen); no real value needs 40.
JSON_DIGIT_CAP = 40
_DIGITS: dict = {}


def digit_tables(tokenizer, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token: (its leading digits, its trailing digits, whether it is all digits), from its
    text; built once per tokenizer."""
    key = (id(tokenizer), vocab_size)
    if key not in _DIGITS:
        lead = np.zeros(vocab_size, np.int32)
        trail = np.zeros(vocab_size, np.int32)
        whole = np.zeros(vocab_size, bool)
        for v in range(vocab_size):
            text = tokenizer.decode([v])
            stripped = text.lstrip("0123456789")
            lead[v] = len(text) - len(stripped)
            trail[v] = len(text) - len(text.rstrip("0123456789"))
            whole[v] = bool(text) and not stripped
        _DIGITS[key] = (tokenizer, (lead, trail, whole))
    return _DIGITS[key][1]


# Between JSON tokens: one space, or a newline and an indent. Bounded, so a weak model cannot
# spend its whole budget on whitespace, and still what models write when pretty-printing.
BOUNDED_WHITESPACE = "[ \n]?[ ]{0,15}"


def json_schema_grammar(schema: dict | None, compact: bool = False) -> str:
    """An llguidance grammar for JSON matching `schema` (None: any JSON object); between
    tokens `BOUNDED_WHITESPACE`, or none when `compact`. ConfigError naming the problem when
    the schema cannot be compiled."""
    ll = _llguidance()
    schema = {"type": "object"} if schema is None else schema
    options = {"whitespace_flexible": False} if compact else {"whitespace_pattern": BOUNDED_WHITESPACE}
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    except Exception as e:  # llguidance reports schema errors as ValueError, RuntimeError, ...
        raise ConfigError(f"invalid JSON schema: {e}") from None
    return _validated(grammar, "JSON schema")


def lark_grammar(text: str, what: str = "grammar") -> str:
    """An llguidance grammar from Lark text (which may embed `%json {schema}`)."""
    try:
        grammar = _llguidance().LLMatcher.grammar_from_lark(text)
    except Exception as e:
        raise ConfigError(f"invalid {what}: {e}") from None
    return _validated(grammar, what)


def regex_grammar(pattern: str) -> str:
    """An llguidance grammar for text matching the regular expression `pattern`."""
    return _validated(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")


def _validated(grammar: str, what: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)  # "" when valid
    if error:
        raise ConfigError(f"invalid {what}: {error}")
    return grammar


def masked(rows: mx.array, allowed: np.ndarray) -> mx.array:
    """`rows [R, V]` with the tokens `allowed [>= R, V']` forbids set to -inf (a head padded past
    the tokenizer's vocab keeps its extra columns)."""
    allowed = mx.array(allowed[: rows.shape[0]])
    if rows.shape[-1] > allowed.shape[-1]:
        allowed = mx.pad(allowed, [(0, 0), (0, rows.shape[-1] - allowed.shape[-1])])
    return mx.where(allowed, rows, mx.array(-mx.inf, dtype=rows.dtype))


class GrammarConstraint:
    """Masks for the target's rows along a draft path; `commit` the tokens a step emits."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, grammar: str, mask_drafts: bool = True,
                 digit_cap: int | None = None):
        ll = _llguidance()
        self.mask_drafts = mask_drafts  # greedy: replace forbidden drafts before the verify (`walk`)
        self.vocab_size = vocab_size
        # `digit_cap`: no run of more digits than this (JSON_DIGIT_CAP for JSON replies)
        self.digit_cap, self.digits = digit_cap, 0
        self._digit_tables = digit_tables(tokenizer, vocab_size) if digit_cap else None
        self.matcher = ll.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_ids), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"cannot start the grammar: {self.matcher.get_error()}")
        self._bits = ll.numpy.allocate_token_bitmask(1, vocab_size)
        self._fill = ll.numpy.fill_next_token_bitmask
        self.seconds = 0.0  # time spent computing masks and consuming tokens
        self.walks = 0  # mask walks along at least one draft
        self.forbidden_at: list[int] = []  # per walk that met one: the position of the forbidden draft
        self.repaired = 0  # drafts replaced by an allowed candidate

    def _mask(self, matcher, digits: int = 0) -> np.ndarray:
        self._fill(matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        allowed = bits[: self.vocab_size].astype(bool)
        if self._digit_tables is not None:
            lead = self._digit_tables[0]
            allowed &= (lead == 0) | (digits + lead <= self.digit_cap)
        return allowed

    def _run_after(self, digits: int, token: int) -> int:
        """The trailing digit run after `token`, given the run `digits` before it."""
        if self._digit_tables is None or not 0 <= token < self.vocab_size:
            return 0
        _, trail, whole = self._digit_tables
        return digits + int(trail[token]) if whole[token] else int(trail[token])

    def masks(self, drafts: list[int]) -> np.ndarray:
        """Allowed tokens [len(drafts) + 1, V] per verify row (all True past a forbidden draft)."""
        return self.walk(drafts)[1]

    def walk(self, drafts: list[int], candidates=None) -> tuple[list[int], np.ndarray]:
        """(the drafts, allowed tokens per verify row) along the draft path, on a copy of the
        matcher; rows past a forbidden draft are all True (never used).

        With `candidates` (a callable giving, per position, the drafter's ids best first; called
        once, at the first forbidden draft) a forbidden draft is replaced by the best allowed
        candidate and the walk goes on along the repaired path. Only for deterministic
        proposals: any draft is exact under greedy verification, but a sampled proposal's q
        would no longer describe the drafts. A draft the matcher refuses to consume (though its
        mask bit was set) is marked forbidden in its row, so the real state never errs.
        """
        t0 = time.perf_counter()
        out, listed = list(drafts), None
        rows = np.ones((len(out) + 1, self.vocab_size), dtype=bool)
        walker = self.matcher.deep_copy() if out else self.matcher
        self.walks += bool(out)
        digits = self.digits
        for i in range(len(out) + 1):
            rows[i] = self._mask(walker, digits)
            if i == len(out):
                break
            if not rows[i][out[i]] and candidates is not None:
                listed = candidates() if listed is None else listed
                better = next((c for c in listed[i] if c < self.vocab_size and rows[i][c]), None)
                if better is not None:
                    out[i] = better
                    self.repaired += 1
            if rows[i][out[i]] and not walker.consume_token(out[i]):
                rows[i][out[i]] = False
            if not rows[i][out[i]]:  # the draft the grammar forbids: the verify rejects it here
                self.forbidden_at.append(i)
                break
            digits = self._run_after(digits, out[i])
        self.seconds += time.perf_counter() - t0
        return out, rows

    def apply(self, rows: mx.array, drafts: list[int], allowed: np.ndarray | None = None) -> mx.array:
        """`rows [R, V]` with the tokens the grammar forbids at each row set to -inf (`allowed`:
        the masks `walk` already computed for these drafts, else they are computed here)."""
        return masked(rows, self.masks(drafts) if allowed is None else allowed)

    def consume(self, tokens: list[int]) -> None:
        t0 = time.perf_counter()
        for t in tokens:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"the grammar rejected emitted token {t}: {self.matcher.get_error()}")
            self.digits = self._run_after(self.digits, t)
        self.seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
