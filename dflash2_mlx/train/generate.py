"""On-policy training data at the machine's decode rate: the target answers prompts in one
continuous batch, and its tapped hidden states and top-k log-probs are captured *while* it
generates, so no second target pass is needed.

Rows join the batch as others finish (no drain between shards): a group of waiting prompts of
similar length (the queue is sorted by length) is prefilled left-padded in one pass and merged
into the running batch with mlx-lm's batch caches (`BatchKVCache.extend` / `filter`). Decoding
is greedy: the labels are the target's own picks.

Per finished prompt, with P the tokens the target picked (`P[-1]` is EOS or the last one
allowed):

* the stored sequence is `prompt + P[:-1]` (every token that was fed back), so every position
  has its tapped states; `P[-1]` is the label of the last position (`next_token`);
* the top-k log-probs cover positions `len(prompt) - 1 .. end`, the ones whose label the
  target picked (the response positions anchors and labels use).

`extract_features` in `data.py` is the slow twin: one teacher-forced pass per stored sequence
gives the same labels and, within float rounding, the same states (a test compares them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import ConfigError

TOP_K = 32


@dataclass
class Generated:
    """One answered prompt, captured during generation."""

    index: int  # the prompt's index in the run's prompt list
    prompt: list[int]
    response: list[int]  # the target's picks that were fed back (P[:-1])
    next_token: int  # the target's pick after the last stored token (EOS, or the cut)
    finish: str  # "stop" (EOS) or "length"
    hidden: np.ndarray  # [len(prompt) + len(response), n_taps * H] float16
    top_ids: np.ndarray  # [len(response) + 1, k] int32, best first: positions len(prompt)-1 .. end
    top_logprobs: np.ndarray  # [len(response) + 1, k] float16

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    @property
    def labels(self) -> list[int]:
        """The target's pick after each stored position from `len(prompt) - 1` on."""
        return self.response + [self.next_token]


@dataclass
class _Row:
    index: int
    prompt: list[int]
    max_new: int
    picked: list[int] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_lp: list[np.ndarray] = field(default_factory=list)


def top_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, k] int32 best first, log-probs [B, k] float32) of the rows of `logits [B, V]`.

    In NumPy: its vectorised exp makes the full-vocab log-sum-exp ~10x faster than MLX's CPU
    backend here, and this runs once per decoding step."""
    x = np.asarray(logits, dtype=np.float32)
    top = x.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    ids = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, ids, axis=-1) - lse
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1).astype(np.int32), np.take_along_axis(vals, order, axis=-1)


class CaptureGenerator:
    """Greedy continuous batching over a target with taps and top-k capture.

    Args:
        target: a `Target`; taps: its layer ids whose outputs are stored.
        batch_size: rows decoding at once; join_min: free rows that trigger a join (fewer
            only when no row is running); prefill_tokens: padded tokens per joining pass.
        max_new_tokens: tokens the target may pick per prompt (P above); top_k: log-probs kept.
    """

    def __init__(self, target, taps: tuple[int, ...], *, batch_size: int = 64, join_min: int = 8,
                 prefill_tokens: int = 2048, max_new_tokens: int = 160, top_k: int = TOP_K):
        if max_new_tokens < 2:
            raise ConfigError(f"max_new_tokens must be >= 2 (one fed token and its label), got {max_new_tokens}")
        if not taps or max(taps) >= target.n_layers or min(taps) < 0:
            raise ConfigError(f"taps must be layer ids in 0..{target.n_layers - 1}, got {list(taps)}")
        self.target, self.taps = target, tuple(taps)
        self.batch_size, self.join_min, self.prefill_tokens = batch_size, min(join_min, batch_size), prefill_tokens
        self.max_new, self.top_k = max_new_tokens, min(top_k, target.info.vocab_size)
        self.eos = frozenset(target.eos_token_ids)
        self.stats = {"prefill_tokens": 0, "prefill_padding": 0, "decode_steps": 0, "decode_rows": 0}

    def run(self, prompts: list[tuple[int, list[int]]]) -> Iterator[Generated]:
        """Answer `(index, prompt ids)` pairs; yields each as it finishes (not in input order)."""
        queue = deque(sorted(prompts, key=lambda p: (len(p[1]), p[0])))
        rows: list[_Row] = []
        cache = None
        last = None  # [B] the token each row feeds next
        while queue or rows:
            free = self.batch_size - len(rows)
            if queue and (free >= self.join_min or not rows):
                group = self._take(queue, free)
                new_cache, first = self._prefill(group)
                if cache is None:
                    cache, last = new_cache, first
                else:
                    for c, n in zip(cache, new_cache):
                        c.extend(n)
                    last = mx.concatenate([last, first])
                rows += group
            done, last = self._decode(rows, cache, last)
            if done:
                keep = [i for i in range(len(rows)) if i not in done]
                for i in sorted(done):
                    yield self._finish(rows[i])
                rows = [rows[i] for i in keep]
                if rows:
                    idx = mx.array(keep)
                    for c in cache:
                        c.filter(idx)
                    last = last[idx]
                else:
                    cache, last = None, None

    def _take(self, queue: deque, free: int) -> list[_Row]:
        group = [queue.popleft()]
        while queue and len(group) < free and (len(group) + 1) * len(queue[0][1]) <= self.prefill_tokens:
            group.append(queue.popleft())
        return [_Row(i, list(ids), self.max_new) for i, ids in group]

    def _prefill(self, group: list[_Row]):
        """One left-padded pass over the joining prompts: their caches and first picks."""
        lengths = [len(r.prompt) for r in group]
        width = max(lengths)
        pads = [width - n for n in lengths]
        tokens = mx.array([[0] * p + r.prompt for p, r in zip(pads, group)])
        cache = self._empty_cache(pads)
        logits, hidden = self.target.forward(tokens, cache, self.taps, logits="last")
        picks, ids, lps, hidden = self._read(logits[:, -1], hidden)
        for b, (r, p) in enumerate(zip(group, pads)):
            r.hidden.append(hidden[b, p:])
            self._record(r, picks[b], ids[b], lps[b])
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefill_padding"] += sum(pads)
        return cache, mx.array(picks)

    def _decode(self, rows: list[_Row], cache, last: mx.array) -> tuple[set[int], mx.array]:
        """One step: feed each unfinished row its last pick. Returns (finished row numbers, next feeds).

        A row whose last pick ended it (EOS or its limit) is not fed again: it leaves before this
        step's results are read, so its unused output is simply ignored.
        """
        done = {i for i, r in enumerate(rows) if self._ended(r)}
        if len(done) == len(rows):
            return done, last
        logits, hidden = self.target.forward(last[:, None], cache, self.taps, logits="last")
        picks, ids, lps, hidden = self._read(logits[:, -1], hidden)
        for b, r in enumerate(rows):
            if b in done:
                continue
            r.hidden.append(hidden[b])
            self._record(r, picks[b], ids[b], lps[b])
            if self._ended(r):
                done.add(b)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(rows)
        return done, mx.array(picks)

    def _ended(self, r: _Row) -> bool:
        return bool(r.picked) and (r.picked[-1] in self.eos or len(r.picked) >= r.max_new)

    def _read(self, logits: mx.array, hidden: mx.array):
        picks = mx.argmax(logits, axis=-1)
        logits = logits.astype(mx.float32)
        hidden = hidden.astype(mx.float16)
        mx.eval(picks, logits, hidden)
        ids, lps = top_logprobs(logits, self.top_k)
        return picks.tolist(), ids, lps.astype(np.float16), np.array(hidden)

    @staticmethod
    def _record(r: _Row, pick: int, ids: np.ndarray, lps: np.ndarray) -> None:
        r.picked.append(int(pick))
        r.top_ids.append(ids)
        r.top_lp.append(lps)

    def _empty_cache(self, pads: list[int]) -> list:
        """mlx-lm's batched caches for len(pads) empty rows, left-padded by `pads`."""
        caches = []
        for layer in zip(*(self.target.base_cache() for _ in pads)):
            merge = getattr(type(layer[0]), "merge", None)
            if merge is None:
                raise ConfigError(f"{type(layer[0]).__name__} layers have no batched form in mlx-lm; "
                                  "on-policy capture needs one")
            batched = merge(list(layer))
            batched.prepare(left_padding=pads)
            caches.append(batched)
        return caches

    def _finish(self, r: _Row) -> Generated:
        hidden = np.concatenate([h.reshape(-1, h.shape[-1]) for h in r.hidden])
        assert len(hidden) == len(r.prompt) + len(r.picked) - 1, (len(hidden), len(r.prompt), len(r.picked))
        finish = "stop" if r.picked[-1] in self.eos else "length"
        return Generated(r.index, r.prompt, r.picked[:-1], r.picked[-1], finish, hidden,
                         np.stack(r.top_ids), np.stack(r.top_lp))
