"""The drafter's training forward: many blocks of a sequence in one pass with a block mask.

For a sequence of T tokens with tapped target states and A anchors t_a, block a is
`[x_{t_a}, MASK x (B-1)]` at positions t_a .. t_a+B-1. Its queries see the fused context of
positions strictly before t_a (inside the sliding window) and the keys of their own block only
(bidirectional, or causal for causal layers); never another block. The layer code (norms,
convolutions, MLP, residuals) is the inference code (`DraftLayer.__call__`); only the
attention sublayer differs, and a test checks that one block trained this way equals
`Drafter.propose`'s forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class FrozenParts:
    """The target's frozen, shared pieces a drafter needs in training (duck-types `Target`)."""

    embed_weight: mx.array  # [V, H_t]
    head_weight: mx.array  # [V, H_t] (the tied embedding, or lm_head.weight)
    embed_scale: float = 1.0

    @classmethod
    def from_target(cls, target) -> "FrozenParts":
        emb = target.inner.embed_tokens
        head = target._head
        head_w = head.weight if isinstance(head, nn.Module) else emb.weight
        if isinstance(emb, nn.QuantizedEmbedding) or isinstance(head, nn.QuantizedLinear):
            raise ValueError("training needs a target with unquantized embedding and head")
        return cls(mx.stop_gradient(emb.weight), mx.stop_gradient(head_w), target.info.embed_scale or 1.0)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_weight[tokens]
        return h if self.embed_scale == 1.0 else h * self.embed_scale

    def head(self, hidden: mx.array) -> mx.array:
        return hidden @ self.head_weight.T


def training_mask(anchors: mx.array, n_ctx: int, valid_ctx: mx.array, block_size: int,
                  window: int | None, causal: bool) -> mx.array:
    """Boolean mask [S, 1, A*B, T + A*B] for the flattened blocks of each sequence.

    anchors [S, A] (positions), valid_ctx [S] (real context length of each padded sequence).
    """
    S, A = anchors.shape
    B, T = block_size, n_ctx
    k = mx.arange(B)
    q_pos = (anchors[:, :, None] + k).reshape(S, A * B)[:, :, None]  # [S, AB, 1]
    p = mx.arange(T)[None, None, :]
    ctx_ok = (p < mx.repeat(anchors, B, axis=1)[:, :, None]) & (p < valid_ctx[:, None, None])
    if window is not None:
        ctx_ok = ctx_ok & (q_pos - p < window)
    qa = mx.repeat(mx.arange(A), B)[:, None]
    ka = mx.repeat(mx.arange(A), B)[None, :]
    blk_ok = qa == ka
    if causal:
        blk_ok = blk_ok & (mx.tile(k, A)[None, :] <= mx.tile(k, A)[:, None])
    blk_ok = mx.broadcast_to(blk_ok[None], (S, A * B, A * B))
    return mx.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]


def _block_attention(attn, u: mx.array, ctx: mx.array, anchors: mx.array, rope, mask: mx.array) -> mx.array:
    """Attention sublayer over all blocks. u [S, A, B, H], ctx [S, T, H] -> [S, A, B, H]."""
    S, A, B, H = u.shape
    k_ctx, v_ctx = attn.context_kv(ctx, rope, 0)
    q, k_blk, v_blk = attn.block_qkv(u.reshape(S * A, B, H), rope, anchors.reshape(S * A))

    def flat(t):  # [S*A, heads, B, D] -> [S, heads, A*B, D]
        heads, D = t.shape[1], t.shape[3]
        return t.reshape(S, A, heads, B, D).transpose(0, 2, 1, 3, 4).reshape(S, heads, A * B, D)

    keys = mx.concatenate([k_ctx, flat(k_blk)], axis=2)
    values = mx.concatenate([v_ctx, flat(v_blk)], axis=2)
    return attn.attend(flat(q), keys, values, mask).reshape(S, A, B, H)


def training_hidden(drafter, target_hidden: mx.array, valid_ctx: mx.array, anchor_tokens: mx.array,
                    anchors: mx.array) -> mx.array:
    """Final-normed draft states for every block.

    Shapes:
        target_hidden [S, T, n_taps * H_t] (padded), valid_ctx [S],
        anchor_tokens [S, A] (x_{t_a}), anchors [S, A] (t_a)  ->  [S, A, B, H]
    """
    c = drafter.config
    S, A = anchors.shape
    B = c.block_size
    masks = mx.full((S, A, B - 1), c.mask_token_id, dtype=anchor_tokens.dtype)
    x = drafter.target.embed(mx.concatenate([anchor_tokens[..., None], masks], axis=-1))
    if c.input_embedding_scale != 1.0:
        x = x * c.input_embedding_scale
    ctx = drafter.fuse_context(target_hidden)
    masks_by_kind = {}
    for layer in drafter.layers:
        attn = layer.self_attn
        kind = (attn.window, attn.causal)
        if kind not in masks_by_kind:
            masks_by_kind[kind] = training_mask(anchors, ctx.shape[1], valid_ctx, B, attn.window, attn.causal)
        mask = masks_by_kind[kind]
        x = layer(x, lambda a, u, m=mask: _block_attention(a, u, ctx, anchors, drafter.rope, m))
    return drafter.norm(x)
