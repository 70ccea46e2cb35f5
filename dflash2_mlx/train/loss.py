"""Training losses (dflash-algorithm.md §2.6, §3).

* Block CE: block position k (k = 1..B-1) predicts x_{t+k}; weight w_k = exp(-(k-1)/γ),
  γ = 7 at B = 16 and scaled with the block (γ = 7·B/16) by default; padded/foreign positions
  are masked. With `dpace`, the weights follow each block's own chance of reaching a position
  instead (D-PACE, `dpace_weights`).
* Soft labels: KL(p ‖ q) from the target's stored top-k log-probs p to the draft q, over the
  partition {each top-k id the head can propose} ∪ {everything else} (a tail bucket), so the
  truncated divergence stays a proper one.
* DFlash 2 selector CE and TV: over the top-k candidates of each position, scored with the TRUE
  predecessor (the anchor for k = 1, else x_{t+k-1}); the target is the index of the true
  token among the candidates. A position whose true token is not a candidate is excluded
  (its share is reported as 1 - Recall@k), or with `inject_gold` the weakest candidate is
  replaced by it, so the selector terms also raise the true token's unary logit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    top_ids: mx.array | None = None  # [S, A, B-1, k] the target's best next tokens (soft labels)
    top_logprobs: mx.array | None = None  # [S, A, B-1, k] their log-probs (-inf: none)


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
    kl: float = 0.0  # soft-label KL to the target's top-k


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


def dpace_weights(ce: mx.array, mask: mx.array, alpha: float = 0.5) -> mx.array:
    """[S, A, L] D-PACE weights: w_j = Σ_{m≥j} Π_{i≤m} q̃_i with q̃ = (1-α)·exp(-CE) + α (detached),
    the expected number of accepted positions a block gains through position j."""
    q = (1 - alpha) * mx.exp(-mx.stop_gradient(ce)) + alpha
    reach = mx.cumprod(mx.where(mask > 0, q, 0.0), axis=-1)
    return mx.cumsum(reach[..., ::-1], axis=-1)[..., ::-1]


def soft_label_kl(logits: mx.array, top_ids: mx.array, top_logprobs: mx.array,
                  column_index: mx.array | None = None) -> mx.array:
    """[S, A, L] KL(p ‖ q) over {each stored top-k id with a logit column} ∪ {the rest}.

    logits [S, A, L, C] (columns = vocab ids, or `column_index[id]` with -1 for ids the head
    lacks); top_ids / top_logprobs [S, A, L, k]. The rest's mass is 1 minus the listed mass,
    for p and q alike.
    """
    log_q = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    cols = top_ids if column_index is None else column_index[top_ids]
    listed = (cols >= 0) & (top_logprobs > -mx.inf)
    p = mx.where(listed, mx.exp(top_logprobs), 0.0)
    lq = mx.take_along_axis(log_q, mx.maximum(cols, 0).astype(mx.int32).reshape(*cols.shape[:-1], -1), axis=-1)
    lq = lq.reshape(cols.shape)
    q_listed = mx.where(listed, mx.exp(lq), 0.0)
    p_rest = mx.clip(1.0 - p.sum(-1), 0.0, 1.0)
    q_rest = mx.clip(1.0 - q_listed.sum(-1), 1e-9, 1.0)
    listed_term = mx.where(listed, p * (mx.where(listed, top_logprobs, 0.0) - lq), 0.0).sum(-1)
    rest_term = mx.where(p_rest > 0, p_rest * (mx.log(mx.maximum(p_rest, 1e-30)) - mx.log(q_rest)), 0.0)
    return listed_term + rest_term


class SelectorTerms(NamedTuple):
    """Per-position selector terms, [S, A, B-1] each."""

    ce: mx.array  # CE over the candidates, scored with the true predecessor
    tv: mx.array  # 1 - q(true token)
    trained: mx.array  # where the terms count: the true token is a candidate (injected or not)
    picked: mx.array  # the walk would pick the true token (from the real top-k)
    in_set: mx.array  # the true token is among the real top-k (Recall@k)


def selector_terms(selector, hidden: mx.array, logits: mx.array, batch: Batch, column_ids: mx.array | None = None,
                   label_columns: mx.array | None = None, inject_gold: bool = False):
    """The selector's loss terms and hit masks per position (`SelectorTerms`).

    `column_ids` maps logit columns to vocab ids (a train vocab), and `label_columns` [S, A, B-1]
    is each label's column there (-1: none); both None when columns are ids. `inject_gold`:
    where the true token is not among the top-k, it replaces the weakest candidate (with its
    own unary logit) for the loss; the hit and pick masks stay those of the real top-k.
    """
    k = min(selector.top_k, logits.shape[-1])
    cols = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
    cands = cols if column_ids is None else column_ids[cols]
    hit = cands == batch.labels[..., None]
    in_set = hit.any(-1)
    if inject_gold:
        label_col = batch.labels if column_ids is None else mx.maximum(label_columns, 0)
        unary_all = mx.take_along_axis(logits, cols, axis=-1)
        weakest = mx.argmin(unary_all, axis=-1, keepdims=True) == mx.arange(k)
        swap = weakest & ~in_set[..., None]
        if column_ids is not None:
            swap = swap & (label_columns >= 0)[..., None]
        cols = mx.where(swap, label_col[..., None], cols)
        cands = cols if column_ids is None else column_ids[cols]
    unary = mx.take_along_axis(logits, cols, axis=-1).astype(mx.float32)
    prev = mx.concatenate([batch.anchor_tokens[..., None], batch.labels[..., :-1]], axis=-1)
    gate = selector.hidden_projection(hidden)
    pair = (selector.predecessor_codebook(prev) * gate)[..., None, :] * selector.successor_codebook(cands)
    scores = unary + pair.sum(-1).astype(mx.float32)
    gold = cands == batch.labels[..., None]
    target = mx.argmax(gold, axis=-1)
    ce = nn.losses.cross_entropy(scores, target, reduction="none")
    q_true = mx.take_along_axis(mx.softmax(scores, axis=-1), target[..., None], axis=-1)[..., 0]
    tv = 1.0 - q_true
    picked = (mx.argmax(scores, axis=-1) == target) & in_set
    return SelectorTerms(ce, tv, gold.any(-1) if inject_gold else in_set, picked, in_set)


def drafter_loss(drafter, batch: Batch, weights: mx.array, loss_weights: LossWeights = LossWeights(),
                 vocab: TrainVocab | None = None, head: mx.array | None = None, block_size: int | None = None,
                 dpace: bool = False, inject_gold: bool = False):
    """Scalar loss and a dict of per-position metric arrays ([B-1] each, unweighted).

    With `vocab` (and its gathered `head` rows [Vs, H]) logits cover the subset only.
    `block_size` runs the drafter at another block size than its config's (its weights do not
    depend on it); `weights` must then have block_size - 1 entries.
    """
    h = training_hidden(drafter, batch.hidden, batch.valid_ctx, batch.anchor_tokens, batch.anchors,
                        block_size=block_size)[:, :, 1:]
    mask = batch.label_mask.astype(mx.float32)
    if vocab is None:
        logits, cols, column_ids = drafter.logits(h), batch.labels, None
    else:
        logits = drafter._transform(h @ head.T)
        cols, column_ids = vocab.index[batch.labels], vocab.ids
    label_columns = None if vocab is None else cols
    in_vocab = (cols >= 0).astype(mx.float32)
    cols = mx.maximum(cols, 0)
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), cols, reduction="none")
    w = (dpace_weights(ce, mask * in_vocab) if dpace else weights) * mask
    ce_loss = _masked_mean(ce, w * in_vocab)
    loss = loss_weights.ce * ce_loss
    count = mx.maximum(mask.sum(axis=(0, 1)), 1.0)
    top1 = (mx.argmax(logits, axis=-1) == cols).astype(mx.float32) * mask * in_vocab
    metrics = {"ce": ce_loss, "top1": top1.sum(axis=(0, 1)) / count}
    if loss_weights.kl and batch.top_ids is not None:
        kl = soft_label_kl(logits, batch.top_ids, batch.top_logprobs, None if vocab is None else vocab.index)
        metrics["kl"] = _masked_mean(kl, w)
        loss = loss + loss_weights.kl * metrics["kl"]
    if drafter.config.is_v2:
        sel_ce, tv, trained, picked, in_set = selector_terms(drafter.candidate_selector, h, logits, batch,
                                                             column_ids, label_columns, inject_gold)
        sel_w = w * trained
        sel_loss, tv_loss = _masked_mean(sel_ce, sel_w), _masked_mean(tv, sel_w)
        loss = loss + loss_weights.selector_ce * sel_loss + loss_weights.selector_tv * tv_loss
        metrics.update(
            selector_ce=sel_loss, selector_tv=tv_loss,
            recall=(in_set * mask).sum(axis=(0, 1)) / count,
            pick=(picked * mask).sum(axis=(0, 1)) / count,
        )
        metrics["_hits"] = picked.astype(mx.float32) * mask
    else:
        metrics["_hits"] = top1
    metrics["loss"] = loss
    return loss, metrics


def estimated_tau(accuracy_by_position) -> float:
    """τ if position k is accepted with its (unconditional) accuracy, chained: 1 + Σ Π acc."""
    tau, run = 1.0, 1.0
    for acc in accuracy_by_position:
        run *= float(acc)
        tau += run
    return tau
