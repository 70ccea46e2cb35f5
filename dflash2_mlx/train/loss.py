"""Training losses (dflash-algorithm.md §2.6, §3).

* Block CE: block position k (k = 1..B-1) predicts x_{t+k}; weight w_k = exp(-(k-1)/γ),
  γ = 7 at B = 16 and scaled with the block (γ = 7·B/16) by default; padded/foreign positions
  are masked.
* DFlash 2 selector CE: over the top-k candidates of each position, scored with the TRUE
  predecessor (the anchor for k = 1, else x_{t+k-1}); the target is the index of the true
  token among the candidates; positions whose true token is not a candidate are excluded
  (their share is reported as 1 - Recall@k). Same position weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .model import training_hidden


def position_weights(block_size: int, gamma: float | None = None) -> mx.array:
    """[B-1] decay weights for block positions 1..B-1."""
    gamma = gamma if gamma is not None else 7.0 * block_size / 16.0
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / gamma)


@dataclass
class Batch:
    """One training batch (all mx arrays).

    hidden [S, T, n_taps*H_t], valid_ctx [S], anchors [S, A], anchor_tokens [S, A],
    labels [S, A, B-1] (x_{t+k}), label_mask [S, A, B-1] (1 where the label counts)
    """

    hidden: mx.array
    valid_ctx: mx.array
    anchors: mx.array
    anchor_tokens: mx.array
    labels: mx.array
    label_mask: mx.array


def _masked_mean(values: mx.array, weights: mx.array) -> mx.array:
    return (values * weights).sum() / mx.maximum(weights.sum(), 1e-9)


def selector_terms(selector, hidden: mx.array, logits: mx.array, batch: Batch):
    """(selector CE per position, candidate hit mask, pick-correct mask), shapes [S, A, B-1]."""
    k = min(selector.top_k, logits.shape[-1])
    cands = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
    unary = mx.take_along_axis(logits, cands, axis=-1).astype(mx.float32)
    prev = mx.concatenate([batch.anchor_tokens[..., None], batch.labels[..., :-1]], axis=-1)
    gate = selector.hidden_projection(hidden)
    pair = (selector.predecessor_codebook(prev) * gate)[..., None, :] * selector.successor_codebook(cands)
    scores = unary + pair.sum(-1).astype(mx.float32)
    hit = cands == batch.labels[..., None]
    in_set = hit.any(-1)
    target = mx.argmax(hit, axis=-1)
    ce = nn.losses.cross_entropy(scores, target, reduction="none")
    picked = (mx.argmax(scores, axis=-1) == target) & in_set
    return ce, in_set, picked


def drafter_loss(drafter, batch: Batch, weights: mx.array, selector_weight: float = 1.0):
    """Scalar loss and a dict of per-position metric arrays ([B-1] each, unweighted)."""
    h = training_hidden(drafter, batch.hidden, batch.valid_ctx, batch.anchor_tokens, batch.anchors)[:, :, 1:]
    logits = drafter.logits(h)
    mask = batch.label_mask.astype(mx.float32)
    w = weights * mask
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), batch.labels, reduction="none")
    loss = _masked_mean(ce, w)
    count = mx.maximum(mask.sum(axis=(0, 1)), 1.0)
    top1 = (mx.argmax(logits, axis=-1) == batch.labels).astype(mx.float32) * mask
    metrics = {"ce": loss, "top1": top1.sum(axis=(0, 1)) / count}
    if drafter.config.is_v2:
        sel_ce, in_set, picked = selector_terms(drafter.candidate_selector, h, logits, batch)
        sel_w = w * in_set
        sel_loss = _masked_mean(sel_ce, sel_w)
        loss = loss + selector_weight * sel_loss
        metrics.update(
            selector_ce=sel_loss,
            recall=(in_set * mask).sum(axis=(0, 1)) / count,
            pick=(picked * mask).sum(axis=(0, 1)) / count,
        )
    metrics["loss"] = loss
    return loss, metrics


def estimated_tau(accuracy_by_position) -> float:
    """τ if position k is accepted with its (unconditional) accuracy, chained: 1 + Σ Π acc."""
    tau, run = 1.0, 1.0
    for acc in accuracy_by_position:
        run *= float(acc)
        tau += run
    return tau
