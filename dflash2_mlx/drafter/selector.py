"""DFlash 2's learned candidate (path) selector (dflash-algorithm.md §2.4).

For each draft position t (t = 0 is block position 1) keep the top-k candidates of the
draft logits U_t and score every (predecessor a, candidate b) pair:

    S_t(a, b) = U_t(b) + < A[a] * G(h_t), B[b] >

A, B are the [V, r] predecessor/successor codebooks, G the [r, H] hidden projection. The
predecessors of position t are the k candidates of t-1 (the anchor token for t = 0), so all
scores form one lattice [B, L, k, k] computed in a single batched matmul; the walk then
only gathers. Greedy: argmax chain. Sampling: at each step draw from softmax(S_t(pred,.)/T)
by inverse CDF of a pre-drawn uniform (clamped to the last candidate with q > 0); that row
is q_t for rejection sampling, and it is conditional on the sampled predecessor, which keeps
the sequential p/q test exact.

`lattice_ops`, `greedy_walk_ops`, `sampled_walk_ops` are the pure-MLX twins of the fused
Metal kernels (`kernels/selector.py`); `select` dispatches between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class Proposal:
    """A drafted block.

    tokens:     [B, L] proposed ids (the walk's path)
    candidates: [B, L, k] the top-k ids per position, or None (v1)
    q:          [B, L, k] proposal probabilities over `candidates` (sampled walk), or None
                when proposals are deterministic (greedy; q is then one-hot on `tokens`)
    logits:     [B, L, V] the draft logits (kept for diagnostics; lazily evaluated), or
                [B, L, K] over a proposal vocab
    vocab_ids:  [K] the vocab id of each logits column with a proposal vocab, else None
    """

    tokens: mx.array
    candidates: mx.array | None = None
    q: mx.array | None = None
    logits: mx.array | None = None
    vocab_ids: mx.array | None = None


def topk_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-k ids and their logits, sorted by logit (descending) for a stable order.

    Shapes: logits [B, L, V] -> (candidates [B, L, k] int32, unary [B, L, k] float32)
    """
    part = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    unary = mx.take_along_axis(logits, part, axis=-1).astype(mx.float32)
    order = mx.argsort(-unary, axis=-1)
    return mx.take_along_axis(part, order, axis=-1).astype(mx.int32), mx.take_along_axis(unary, order, axis=-1)


def _rows(codebook, ids: mx.array) -> mx.array:
    # A codebook is a dense [V, r] array or an (optionally quantized) embedding module.
    return codebook(ids) if isinstance(codebook, nn.Module) else codebook[ids]


def predecessor_ids(candidates: mx.array, anchor: mx.array) -> mx.array:
    """[B, L, k]: the predecessor token of each lattice row (the anchor for t = 0)."""
    B, L, k = candidates.shape
    first = mx.broadcast_to(anchor.reshape(B, 1, 1).astype(candidates.dtype), (B, 1, k))
    return mx.concatenate([first, candidates[:, :-1]], axis=1) if L > 1 else first


def lattice_ops(candidates: mx.array, unary: mx.array, gate: mx.array, pred_codebook,
                succ_codebook, anchor: mx.array) -> mx.array:
    """All pair scores of the block in one shot, accumulated in float32.

    Shapes:
        candidates [B, L, k] int, unary [B, L, k], gate [B, L, r], codebooks [V, r], anchor [B]
        returns    [B, L, k, k]: [b, t, i, j] = score of candidate j at t after predecessor i
                   (predecessor i of t is candidate i of t-1; every row of t = 0 is the anchor)
    """
    pred = _rows(pred_codebook, predecessor_ids(candidates, anchor)).astype(mx.float32)
    a = pred * gate.astype(mx.float32)[:, :, None, :]
    b = _rows(succ_codebook, candidates).astype(mx.float32)
    return unary[:, :, None, :] + a @ b.swapaxes(-1, -2)


def greedy_walk_ops(lattice: mx.array) -> mx.array:
    """Argmax chain through the lattice. Shapes: [B, L, k, k] -> indices [B, L] int32."""
    follow = mx.argmax(lattice, axis=-1).astype(mx.int32)  # [B, L, k]: best next given pred
    idx = follow[:, 0, 0]
    path = [idx]
    for t in range(1, lattice.shape[1]):
        idx = mx.take_along_axis(follow[:, t], idx[:, None], axis=-1)[:, 0]
        path.append(idx)
    return mx.stack(path, axis=1)


def sampled_walk_ops(lattice: mx.array, temperature: float, uniforms: mx.array) -> tuple[mx.array, mx.array]:
    """Sampled walk by inverse CDF of pre-drawn uniforms.

    Shapes: lattice [B, L, k, k], uniforms [B, L] in [0, 1) -> (indices [B, L] int32, q [B, L, k])
    """
    B, L, k, _ = lattice.shape
    idx = mx.zeros((B,), dtype=mx.int32)
    path, q_rows = [], []
    for t in range(L):
        row = mx.take_along_axis(lattice[:, t], idx[:, None, None], axis=1)[:, 0]
        q = mx.softmax(row / temperature, axis=-1, precise=True)
        cdf = mx.cumsum(q, axis=-1)
        # Rounding can leave cdf[-1] <= u: clamp to the last candidate with mass, never to a q = 0 one.
        last = mx.max(mx.where(q > 0, mx.arange(k), 0), axis=-1)
        idx = mx.minimum(mx.sum(cdf <= uniforms[:, t : t + 1], axis=-1), last).astype(mx.int32)
        path.append(idx)
        q_rows.append(q)
    return mx.stack(path, axis=1), mx.stack(q_rows, axis=1)


def select(candidates, unary, gate, pred_codebook, succ_codebook, anchor, temperature: float,
           uniforms: mx.array | None = None, use_kernel: bool | None = None):
    """Lattice + walk. Returns (indices [B, L], q [B, L, k] or None).

    Dispatches to the fused Metal kernel on a Metal GPU for the inputs it takes, unless
    `use_kernel` is False; the MLX-ops twin runs everywhere else and gives the same results.
    """
    from ..kernels import selector as kernel

    if kernel.should_use(use_kernel) and kernel.fits(candidates, gate, pred_codebook, succ_codebook):
        return kernel.select_kernel(candidates, unary, gate, pred_codebook, succ_codebook, anchor,
                                    temperature, uniforms)
    lattice = lattice_ops(candidates, unary, gate, pred_codebook, succ_codebook, anchor)
    if temperature <= 0:
        return greedy_walk_ops(lattice), None
    return sampled_walk_ops(lattice, temperature, uniforms)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)

    def codebooks(self):
        """Dense [V, r] arrays when unquantized (what the kernel takes), else the modules."""
        pred, succ = self.predecessor_codebook, self.successor_codebook
        if type(pred) is nn.Embedding and type(succ) is nn.Embedding:
            return pred.weight, succ.weight
        return pred, succ

    def __call__(self, hidden: mx.array, logits: mx.array, anchor: mx.array, temperature: float,
                 key: mx.array | None = None, use_kernel: bool | None = None,
                 vocab_ids: mx.array | None = None) -> Proposal:
        """Pick a path through the top-k candidates of each position.

        Shapes: hidden [B, L, H] (final-normed), logits [B, L, V] (or [B, L, K] over the
        proposal vocab `vocab_ids [K]`, whose columns map back to vocab ids), anchor [B].
        `key` seeds the sampled walk (required when temperature > 0).
        """
        candidates, unary = topk_candidates(logits, min(self.top_k, logits.shape[-1]))
        if vocab_ids is not None:
            candidates = vocab_ids[candidates]
        gate = self.hidden_projection(hidden)
        uniforms = None
        if temperature > 0:
            if key is None:
                raise ValueError("a sampled selector walk needs an RNG key")
            uniforms = mx.random.uniform(shape=candidates.shape[:2], key=key)
        pred, succ = self.codebooks()
        idx, q = select(candidates, unary, gate, pred, succ, anchor, temperature, uniforms, use_kernel)
        tokens = mx.take_along_axis(candidates, idx[..., None], axis=-1)[..., 0]
        return Proposal(tokens=tokens, candidates=candidates, q=q, logits=logits, vocab_ids=vocab_ids)
