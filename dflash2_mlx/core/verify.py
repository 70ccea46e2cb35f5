"""Verification: which drafted tokens to keep, and the token that follows them.

Pure functions over dense arrays (llama.cpp's truncated-candidate-list hazard is why q is
scattered into a dense [L, V] row before any arithmetic). Notation: `L` drafted tokens
d_1..d_L, the target distribution rows p_0..p_L (row i is the distribution of the token
after the anchor and d_1..d_i), and the draft distribution rows q_1..q_L.

Greedy: accept the longest prefix with d_i == argmax p_{i-1}; the next token is the
target's argmax after it (the bonus). Sampling (Leviathan et al.): accept d_i with
probability min(1, p(d_i)/q(d_i)); at the first rejection draw from
normalize(max(p - q, 0)) (p itself if that is empty); if all L are accepted, draw the bonus
from p_L. The emitted tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

import mlx.core as mx


def greedy_accept(drafts: list[int], target_choice: list[int]) -> tuple[int, int]:
    """(n_accepted, next_token) for `drafts [L]` and the target's argmax rows `[L + 1]`."""
    if len(target_choice) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target rows for {len(drafts)} drafts, got {len(target_choice)}")
    n = 0
    while n < len(drafts) and drafts[n] == target_choice[n]:
        n += 1
    return n, target_choice[n]


def dense_q(q_rows: mx.array, candidates: mx.array, vocab_size: int) -> mx.array:
    """Scatter sparse proposal rows onto the vocabulary.

    Shapes: q_rows [L, k], candidates [L, k] (distinct ids per row) -> [L, V]
    """
    zeros = mx.zeros((q_rows.shape[0], vocab_size), dtype=mx.float32)
    return mx.put_along_axis(zeros, candidates.astype(mx.int32), q_rows.astype(mx.float32), axis=-1)


def one_hot_q(drafts: mx.array, vocab_size: int) -> mx.array:
    """q of a deterministic proposal: all mass on the drafted token. [L] -> [L, V]."""
    return (mx.arange(vocab_size)[None, :] == drafts[:, None]).astype(mx.float32)


def residual_distribution(p: mx.array, q: mx.array) -> mx.array:
    """normalize(max(p - q, 0)) per row, or p where that is all zero. [R, V] -> [R, V]."""
    r = mx.maximum(p - q, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    return mx.where(total > 0, r / mx.maximum(total, 1e-30), p)


def rejection_sample(drafts: mx.array, p: mx.array, q: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling of one block, lazily (evaluate both outputs together).

    Shapes: drafts [L] int, p [L + 1, V] target rows, q [L, V] dense draft rows.
    Returns (n_accepted scalar int32, next_token scalar int32).
    """
    L = drafts.shape[0]
    k_accept, k_next = mx.random.split(key)
    idx = drafts[:, None].astype(mx.int32)
    p_d = mx.take_along_axis(p[:L], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(L,), key=k_accept)
    accepted = (u * q_d < p_d).astype(mx.int32)
    n = mx.cumprod(accepted).sum().astype(mx.int32)
    rows = mx.concatenate([residual_distribution(p[:L], q), p[L:]], axis=0)
    row = mx.take(rows, n, axis=0)
    next_token = mx.random.categorical(mx.log(row), key=k_next).astype(mx.int32)
    return n, next_token
