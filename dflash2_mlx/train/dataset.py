"""Training sequences from feature shards, and the anchors each step trains on.

`FeatureDataset` indexes memory-mapped shards (`shards.py`) by sequence; `batch` copies only the
rows of the sequences a step uses. `AnchorSampler` visits every (sequence, anchor) pair once per
epoch, in an order fixed by (seed, epoch): a sequence is drawn in proportion to its trainable
tokens and its anchors without replacement, so a 10-token reply no longer gets as many blocks
as a 190-token one. `eval_rows` lists every anchor of every sequence, for a deterministic
evaluation.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from .loss import Batch
from .shards import FeatureShard

Rows = list[tuple[int, np.ndarray]]  # (sequence number, anchor positions within it)


def tap_columns(stored: list[int], wanted: list[int] | None, width: int) -> np.ndarray | None:
    """Hidden-state columns of the `wanted` taps in data that stores `stored` (None: all of them)."""
    if wanted is None or list(wanted) == list(stored):
        return None
    missing = [t for t in wanted if t not in stored]
    if missing:
        raise ValueError(f"taps {missing} are not in the data (it stores {stored})")
    h = width // len(stored)
    return np.concatenate([np.arange(stored.index(t) * h, (stored.index(t) + 1) * h) for t in wanted])


class FeatureDataset:
    """The usable sequences of some feature shards (memory-mapped), with batch assembly.

    A block anchored at t (a trainable position) has labels `labels[t + k - 1]` for k = 1..B-1
    (the target's next token after t + k - 1), counted where that position is still trainable.

    `chain_labels`: label k also needs the text after t to follow the target's own argmax up
    to t + k - 1, so every label is the target's greedy continuation of the prefix (what the
    drafter must predict); past the first disagreement of teacher-forced text, the argmax is
    conditioned on tokens the target would not have written. A no-op on regenerated data.
    `columns`: the hidden-state columns to use (a subset of the stored taps), or None for all.
    `prompts`: keep only on-policy sequences whose prompt number is in this set; `max_seqs` /
    `max_trainable`: stop after that many sequences / trainable tokens (in shard order).
    """

    def __init__(self, paths: list[Path], max_seqs: int | None = None, chain_labels: bool = True,
                 columns: np.ndarray | None = None, prompts: set[int] | None = None, max_trainable: int | None = None):
        self.chain_labels, self.columns = chain_labels, columns
        self.shards = [s for s in (FeatureShard.load(p) for p in paths) if len(s)]
        if not self.shards:
            raise ValueError(f"no training sequences in {[str(p) for p in paths]}")
        index, total = [], 0
        for k, s in enumerate(self.shards):
            for i in range(len(s)):
                a, b = int(s.offsets[i]), int(s.offsets[i + 1])
                n = int(s.anchor_ok[a:b].sum())
                prompt = -1 if s.prompt_index is None else int(s.prompt_index[i])
                if n and (prompts is None or prompt in prompts):
                    index.append((k, a, b, n, prompt))
                    total += n
                if (max_seqs and len(index) >= max_seqs) or (max_trainable and total >= max_trainable):
                    break
            else:
                continue
            break
        self.shard_of = np.array([r[0] for r in index], dtype=np.int32)
        self.starts = np.array([r[1] for r in index], dtype=np.int64)
        self.ends = np.array([r[2] for r in index], dtype=np.int64)
        self.n_anchors = np.array([r[3] for r in index], dtype=np.int64)
        self.prompt_index = np.array([r[4] for r in index], dtype=np.int64)  # -1: not on-policy data
        width = self.shards[0].hidden.shape[1]
        self.width = width if columns is None else len(columns)
        self.top_k = min(s.top_k for s in self.shards)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        """Tokens of the sequences in use."""
        return int((self.ends - self.starts).sum())

    @property
    def n_trainable(self) -> int:
        """Positions a block may start at, in the sequences in use."""
        return int(self.n_anchors.sum())

    def _slice(self, i: int, field: str) -> np.ndarray:
        return getattr(self.shards[self.shard_of[i]], field)[self.starts[i] : self.ends[i]]

    def anchor_positions(self, i: int) -> np.ndarray:
        return np.nonzero(self._slice(i, "anchor_ok"))[0]

    def prompt_keys(self) -> set[bytes]:
        """Each sequence's token ids before its first trainable position (its prompt), as bytes:
        an evaluation set sharing one with the training data is not held out."""
        keys = set()
        for i in range(len(self)):
            ok = self._slice(i, "anchor_ok")
            keys.add(np.asarray(self._slice(i, "tokens")[: int(np.argmax(ok))], dtype=np.int32).tobytes())
        return keys

    def batch(self, rows: Rows, block_size: int, n_anchors: int, soft: bool = False) -> Batch:
        """The blocks of `rows` (each with up to `n_anchors` anchors; unused slots are masked)."""
        S, L = len(rows), block_size - 1
        lengths = np.array([self.ends[i] - self.starts[i] for i, _ in rows])
        T = int(math.ceil(lengths.max() / 32) * 32)
        hidden = np.zeros((S, T, self.width), dtype=np.float32)
        anchors = np.zeros((S, n_anchors), dtype=np.int32)
        labels = np.zeros((S, n_anchors, L), dtype=np.int32)
        mask = np.zeros_like(labels, dtype=np.float32)
        anchor_tokens = np.zeros((S, n_anchors), dtype=np.int32)
        k = self.top_k if soft else 0
        top_ids = np.zeros((S, n_anchors, L, k), dtype=np.int32)
        top_lp = np.full((S, n_anchors, L, k), -np.inf, dtype=np.float32)
        for r, (i, pick) in enumerate(rows):
            n, m = int(lengths[r]), len(pick)
            h = self._slice(i, "hidden")
            hidden[r, :n] = h if self.columns is None else h[:, self.columns]
            tokens, seq_labels, ok = self._slice(i, "tokens"), self._slice(i, "labels"), self._slice(i, "anchor_ok")
            anchors[r, :m] = pick
            anchor_tokens[r, :m] = tokens[pick]
            pos = pick[:, None] + np.arange(L)[None, :]
            inside = pos < n
            pos = np.minimum(pos, n - 1)
            labels[r, :m] = np.where(inside, seq_labels[pos], 0)
            valid = inside & (ok[pos] > 0)
            if self.chain_labels:  # token at pos equals the target's argmax after pos - 1
                on_path = tokens[pos] == seq_labels[np.maximum(pos - 1, 0)]
                on_path[:, 0] = True
                valid = valid & (np.cumprod(on_path, axis=1) > 0)
            mask[r, :m] = valid
            if k:
                top_ids[r, :m] = self._slice(i, "top_ids")[pos][..., :k]
                top_lp[r, :m] = np.where(valid[..., None], self._slice(i, "top_logprobs")[pos][..., :k], -np.inf)
        soft_arrays = (mx.array(top_ids), mx.array(top_lp)) if k else (None, None)
        return Batch(mx.array(hidden), mx.array(lengths.astype(np.int32)), mx.array(anchors),
                     mx.array(anchor_tokens), mx.array(labels), mx.array(mask), *soft_arrays)


class AnchorSampler:
    """Every (sequence, anchor) once per epoch, `seqs_per_batch` rows of up to `anchors_per_seq`.

    Epoch e shuffles each sequence's anchors and splits them into near-equal chunks of at most
    `anchors_per_seq`, then shuffles all chunks (both with `default_rng([seed, e])`); step s takes
    chunks s·S .. s·S + S - 1 of the epochs laid end to end. So the rows of a step depend only on
    (seed, step): a resumed run trains on exactly what an uninterrupted one would.
    """

    def __init__(self, data: FeatureDataset, seqs_per_batch: int, anchors_per_seq: int, seed: int = 0):
        self.data, self.S, self.A, self.seed = data, seqs_per_batch, anchors_per_seq, seed
        self.n_chunks = int(sum(math.ceil(n / anchors_per_seq) for n in data.n_anchors))
        self._epoch: tuple[int, Rows] | None = None

    @property
    def steps_per_epoch(self) -> float:
        return self.n_chunks / self.S

    def epoch(self, e: int) -> Rows:
        if self._epoch is None or self._epoch[0] != e:
            rng = np.random.default_rng([self.seed, e])
            chunks: Rows = []
            for i in range(len(self.data)):
                pool = rng.permutation(self.data.anchor_positions(i))
                chunks += [(i, np.sort(c)) for c in np.array_split(pool, math.ceil(len(pool) / self.A))]
            order = rng.permutation(len(chunks))
            self._epoch = (e, [chunks[j] for j in order])
        return self._epoch[1]

    def rows(self, step: int) -> Rows:
        out = []
        for g in range(step * self.S, (step + 1) * self.S):
            out.append(self.epoch(g // self.n_chunks)[g % self.n_chunks])
        return out


def eval_rows(data: FeatureDataset, anchors_per_seq: int) -> Rows:
    """Every anchor of every sequence, in order, as rows of at most `anchors_per_seq`."""
    out: Rows = []
    for i in range(len(data)):
        pool = data.anchor_positions(i)
        out += [(i, pool[j : j + anchors_per_seq]) for j in range(0, len(pool), anchors_per_seq)]
    return out
