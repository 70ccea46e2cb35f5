"""The drafter's training forward: many blocks of a sequence in one pass with a block mask.

For a sequence of T tokens with tapped target states and A anchors t_a, block a is
`[x_{t_a}, MASK x (B-1)]` at positions t_a .. t_a+B-1. Its queries see the fused context of
positions strictly before t_a (inside the sliding window) and the keys of their own block only
(bidirectional, or causal for causal layers); never another block. The layer code (norms,
convolutions, MLP, residuals) is the inference code (`DraftLayer.__call__`); only the
attention sublayer differs, and a test checks that one block trained this way equals
`Drafter.draft_from`'s forward.
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


def context_mask(anchors: mx.array, n_ctx: int, valid_ctx: mx.array, block_size: int,
                 window: int | None) -> mx.array:
    """Boolean [S, 1, A*B, T]: block a's queries see real context positions before t_a (in the window)."""
    S, A = anchors.shape
    B, T = block_size, n_ctx
    q_pos = (anchors[:, :, None] + mx.arange(B)).reshape(S, A * B)[:, :, None]  # [S, AB, 1]
    p = mx.arange(T)[None, None, :]
    ctx_ok = (p < mx.repeat(anchors, B, axis=1)[:, :, None]) & (p < valid_ctx[:, None, None])
    if window is not None:
        ctx_ok = ctx_ok & (q_pos - p < window)
    return ctx_ok[:, None]


def training_mask(anchors: mx.array, n_ctx: int, valid_ctx: mx.array, block_size: int,
                  window: int | None, causal: bool) -> mx.array:
    """Boolean mask [S, 1, A*B, T + A*B] for the flattened blocks of each sequence.

    anchors [S, A] (positions), valid_ctx [S] (real context length of each padded sequence).
    """
    S, A = anchors.shape
    B = block_size
    k = mx.arange(B)
    qa = mx.repeat(mx.arange(A), B)[:, None]
    ka = mx.repeat(mx.arange(A), B)[None, :]
    blk_ok = qa == ka
    if causal:
        blk_ok = blk_ok & (mx.tile(k, A)[None, :] <= mx.tile(k, A)[:, None])
    blk_ok = mx.broadcast_to(blk_ok[None, None], (S, 1, A * B, A * B))
    return mx.concatenate([context_mask(anchors, n_ctx, valid_ctx, B, window), blk_ok], axis=-1)


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


def _local_block_attention(attn, u: mx.array, ctx: mx.array, anchors: mx.array, rope, ctx_mask: mx.array) -> mx.array:
    """`_block_attention` without the [A*B, A*B] cross-block scores: each block's keys are
    scored against its own queries only, so the cost grows linearly with the anchors.

    u [S, A, B, H], ctx [S, T, H], ctx_mask [S, 1, A*B, T] (the context part of the mask).
    """
    S, A, B, H = u.shape
    kvh, D = attn.n_kv_heads, attn.head_dim
    g = attn.n_heads // kvh
    k_ctx, v_ctx = attn.context_kv(ctx, rope, 0)  # [S, kvh, T, D]
    q, k_blk, v_blk = attn.block_qkv(u.reshape(S * A, B, H), rope, anchors.reshape(S * A))
    q = q.reshape(S * A, kvh, g, B, D) * attn.scale
    q_flat = q.reshape(S, A, kvh, g, B, D).transpose(0, 2, 3, 1, 4, 5).reshape(S, kvh, g, A * B, D)
    s_ctx = q_flat @ k_ctx[:, :, None].swapaxes(-1, -2)  # [S, kvh, g, AB, T]
    s_blk = q @ k_blk[:, :, None].swapaxes(-1, -2)  # [S*A, kvh, g, B, B]
    s_blk = s_blk.reshape(S, A, kvh, g, B, B).transpose(0, 2, 3, 1, 4, 5).reshape(S, kvh, g, A * B, B)
    blk_ok = mx.tril(mx.ones((B, B), dtype=mx.bool_)) if attn.causal else mx.ones((B, B), dtype=mx.bool_)
    blk_ok = mx.tile(blk_ok, (A, 1))
    mask = mx.concatenate([mx.broadcast_to(ctx_mask[:, :, None], s_ctx.shape),
                           mx.broadcast_to(blk_ok, s_blk.shape)], axis=-1)
    scores = mx.where(mask, mx.concatenate([s_ctx, s_blk], axis=-1), -mx.inf)
    p = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    T = s_ctx.shape[-1]
    out_ctx = p[..., :T] @ v_ctx[:, :, None]  # [S, kvh, g, AB, D]
    p_blk = p[..., T:].reshape(S, kvh, g, A, B, B).transpose(0, 3, 1, 2, 4, 5).reshape(S * A, kvh, g, B, B)
    out_blk = (p_blk @ v_blk[:, :, None]).reshape(S, A, kvh, g, B, D).transpose(0, 2, 3, 1, 4, 5)
    out = (out_ctx + out_blk.reshape(S, kvh, g, A * B, D)).reshape(S, kvh * g, A * B, D)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(S, A * B, -1)).reshape(S, A, B, H)


def training_hidden(drafter, target_hidden: mx.array, valid_ctx: mx.array, anchor_tokens: mx.array,
                    anchors: mx.array, local: bool = True, block_size: int | None = None) -> mx.array:
    """Final-normed draft states for every block (`local`: the linear-cost attention; False:
    its slow twin with one full [A*B, T + A*B] mask). `block_size` overrides the config's: a
    drafter's weights do not depend on it, so one trained at 8 can be run at 4.

    Shapes:
        target_hidden [S, T, n_taps * H_t] (padded), valid_ctx [S],
        anchor_tokens [S, A] (x_{t_a}), anchors [S, A] (t_a)  ->  [S, A, B, H]
    """
    c = drafter.config
    S, A = anchors.shape
    B = block_size or c.block_size
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
            masks_by_kind[kind] = (context_mask(anchors, ctx.shape[1], valid_ctx, B, attn.window) if local else
                                   training_mask(anchors, ctx.shape[1], valid_ctx, B, attn.window, attn.causal))
        mask = masks_by_kind[kind]
        if local:  # the block part of the mask is implicit: each block attends to itself
            x = layer(x, lambda a, u, m=mask: _local_block_attention(a, u, ctx, anchors, drafter.rope, m))
        else:
            x = layer(x, lambda a, u, m=mask: _block_attention(a, u, ctx, anchors, drafter.rope, m))
    return drafter.norm(x)
