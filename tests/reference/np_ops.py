"""Float64 NumPy references for the drafter's numeric pieces and the verifier."""

from __future__ import annotations

import numpy as np


def grouped_dynamic_conv(x, dyn, base, group_size):
    """x [L, H], dyn [L, K, H/G], base [K, H] -> [L, H], by the defining sum."""
    L, H = x.shape
    out = np.zeros((L, H))
    for t in range(L):
        for o in range(base.shape[0]):
            if t - o < 0:
                continue
            coeff = base[o] + np.repeat(dyn[t, o], group_size)
            out[t] += coeff * x[t - o]
    return out


def pair_score(unary_t, gate_t, pred_row, succ_row):
    return unary_t + float(np.sum(pred_row * gate_t * succ_row))


def selector_lattice(cands, unary, gate, A, B, anchor):
    """Brute force over every (predecessor, candidate) pair. cands/unary [L, k], gate [L, r]."""
    L, k = cands.shape
    lat = np.zeros((L, k, k))
    for t in range(L):
        for i in range(k):
            pred = anchor if t == 0 else cands[t - 1, i]
            for j in range(k):
                lat[t, i, j] = pair_score(unary[t, j], gate[t], A[pred], B[cands[t, j]])
    return lat


def greedy_walk(lat):
    idx, path = 0, []
    for t in range(lat.shape[0]):
        idx = int(np.argmax(lat[t, idx if t else 0]))
        path.append(idx)
    return path


def sampled_walk(lat, temperature, uniforms):
    idx, path, qs = 0, [], []
    for t in range(lat.shape[0]):
        row = lat[t, idx if t else 0] / temperature
        q = np.exp(row - row.max())
        q /= q.sum()
        cdf = np.cumsum(q)
        idx = min(int(np.sum(cdf <= uniforms[t])), int(np.flatnonzero(q > 0)[-1]))
        path.append(idx)
        qs.append(q)
    return path, np.array(qs)


def exact_output_dist(p, q):
    """Distribution of the first emitted token of speculative sampling with one draft."""
    accept = np.minimum(p, q)
    residual = np.maximum(p - q, 0)
    mass = residual.sum()
    residual = residual / mass if mass > 0 else p
    return accept + (1 - accept.sum()) * residual
