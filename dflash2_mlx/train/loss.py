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
import numpy as np

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


@dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms (the DFlash 2 terms apply to v2 drafters only).

    ce: block CE; selector_ce: the selector's CE over the top-k with the true predecessor;
    selector_tv: its total-variation distance to the greedy target, 1 - q(true token) (the
    rejection chance of that position; out-of-set positions have no gradient).
    """

    ce: float = 1.0
    selector_ce: float = 1.0
    selector_tv: float = 0.0


class TrainVocab:
    """Train over a subset of the vocabulary (the proposal vocab the drafter drafts from).

    ids [Vs] sorted ascending; `index[v]` is v's column or -1. Labels outside the subset count
    as misses in the metrics and carry no CE (the compact head can never propose them).
    """

    def __init__(self, ids, vocab_size: int):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0 or (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"train vocab ids must be sorted, unique and in 0..{vocab_size - 1}")
        index = np.full(vocab_size, -1, dtype=np.int32)
        index[ids] = np.arange(len(ids), dtype=np.int32)
        self.ids, self.index, self.size = mx.array(ids.astype(np.int32)), mx.array(index), len(ids)

    def head(self, parts) -> mx.array:
        return parts.head_weight[self.ids]


def _masked_mean(values: mx.array, weights: mx.array) -> mx.array:
    return (values * weights).sum() / mx.maximum(weights.sum(), 1e-9)


def selector_terms(selector, hidden: mx.array, logits: mx.array, batch: Batch, column_ids: mx.array | None = None):
    """(selector CE, TV, candidate hit mask, pick-correct mask) per position, shapes [S, A, B-1].

    `column_ids` maps logit columns to vocab ids (a train vocab); None when columns are ids.
    """
    k = min(selector.top_k, logits.shape[-1])
    cols = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
    cands = cols if column_ids is None else column_ids[cols]
    unary = mx.take_along_axis(logits, cols, axis=-1).astype(mx.float32)
    prev = mx.concatenate([batch.anchor_tokens[..., None], batch.labels[..., :-1]], axis=-1)
    gate = selector.hidden_projection(hidden)
    pair = (selector.predecessor_codebook(prev) * gate)[..., None, :] * selector.successor_codebook(cands)
    scores = unary + pair.sum(-1).astype(mx.float32)
    hit = cands == batch.labels[..., None]
    in_set = hit.any(-1)
    target = mx.argmax(hit, axis=-1)
    ce = nn.losses.cross_entropy(scores, target, reduction="none")
    q_true = mx.take_along_axis(mx.softmax(scores, axis=-1), target[..., None], axis=-1)[..., 0]
    tv = 1.0 - q_true
    picked = (mx.argmax(scores, axis=-1) == target) & in_set
    return ce, tv, in_set, picked


def drafter_loss(drafter, batch: Batch, weights: mx.array, loss_weights: LossWeights = LossWeights(),
                 vocab: TrainVocab | None = None, head: mx.array | None = None):
    """Scalar loss and a dict of per-position metric arrays ([B-1] each, unweighted).

    With `vocab` (and its gathered `head` rows [Vs, H]) logits cover the subset only.
    """
    h = training_hidden(drafter, batch.hidden, batch.valid_ctx, batch.anchor_tokens, batch.anchors)[:, :, 1:]
    mask = batch.label_mask.astype(mx.float32)
    if vocab is None:
        logits, cols, column_ids = drafter.logits(h), batch.labels, None
    else:
        logits = drafter._transform(h @ head.T)
        cols, column_ids = vocab.index[batch.labels], vocab.ids
    in_vocab = (cols >= 0).astype(mx.float32)
    cols = mx.maximum(cols, 0)
    w = weights * mask
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), cols, reduction="none")
    ce_loss = _masked_mean(ce, w * in_vocab)
    loss = loss_weights.ce * ce_loss
    count = mx.maximum(mask.sum(axis=(0, 1)), 1.0)
    top1 = (mx.argmax(logits, axis=-1) == cols).astype(mx.float32) * mask * in_vocab
    metrics = {"ce": ce_loss, "top1": top1.sum(axis=(0, 1)) / count}
    if drafter.config.is_v2:
        sel_ce, tv, in_set, picked = selector_terms(drafter.candidate_selector, h, logits, batch, column_ids)
        sel_w = w * in_set
        sel_loss, tv_loss = _masked_mean(sel_ce, sel_w), _masked_mean(tv, sel_w)
        loss = loss + loss_weights.selector_ce * sel_loss + loss_weights.selector_tv * tv_loss
        metrics.update(
            selector_ce=sel_loss, selector_tv=tv_loss,
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
