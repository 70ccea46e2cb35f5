"""The DFlash v1 / v2 drafter backbone (dflash-algorithm.md §1, §2).

A few Qwen3-style layers with no embedding or head of their own. The target's tapped
hidden states are fused, `c = RMSNorm(fc(concat(taps)))`, and injected as keys/values in
every layer (queries come only from the block). Context K/V are cached per committed token;
the block `[anchor, MASK x (L-1)]` is recomputed each call at absolute positions. In-block
attention is bidirectional unless the layer is causal; sliding layers see only the last
`sliding_window - 1` context positions. DFlash 2 wraps each sublayer in a grouped dynamic
convolution and adds the candidate selector.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..core.cache_kinds import kind_of
from ..errors import ConfigError
from .config import DrafterConfig, check_fits
from .context import DraftContext, draft_caches
from .conv import GroupedDynamicCausalConv
from .selector import CandidateSelector, Proposal
from .vocab import ProposalVocab, head_rows


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _stored(cache) -> tuple[mx.array, mx.array]:
    """Context K/V already in a draft cache, without appending."""
    return kind_of(cache).stored(cache)


def block_attention_mask(n_ctx: int, L: int, window: int | None, causal: bool):
    """Mask [L, n_ctx + L] for block queries over [context ; block] keys, or None if all visible.

    Context key j (position s - n_ctx + j) is visible to block query i (position s + i)
    iff it lies inside the window: n_ctx + i - j < window. Block keys: all, or j <= i.
    """
    ctx_limited = window is not None and n_ctx + L - 1 >= window
    if not ctx_limited and not causal:
        return None
    i = mx.arange(L)[:, None]
    j = mx.arange(n_ctx + L)[None]
    ctx_ok = (j < n_ctx) & ((n_ctx + i - j < window) if ctx_limited else True)
    blk_ok = (j >= n_ctx) & ((j - n_ctx <= i) if causal else True)
    return ctx_ok | blk_ok


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig, index: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.window = c.sliding_window if c.layer_types[index] == "sliding_attention" else None
        self.causal = c.causal[index]
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def _heads(self, x, n, norm=None):
        *lead, L, _ = x.shape
        x = x.reshape(*lead, L, n, self.head_dim)
        return (norm(x) if norm is not None else x).swapaxes(-2, -3)

    def context_kv(self, ctx: mx.array, rope, offset) -> tuple[mx.array, mx.array]:
        """Keys/values of fused context rows [B, S, H] at positions offset.. -> [B, kv, S, D] each."""
        k = rope(self._heads(self.k_proj(ctx), self.n_kv_heads, self.k_norm), offset=offset)
        return k, self._heads(self.v_proj(ctx), self.n_kv_heads)

    def block_qkv(self, x: mx.array, rope, offset):
        """Queries/keys/values of block rows [B, L, H] starting at position `offset` (int or [B])."""
        q = rope(self._heads(self.q_proj(x), self.n_heads, self.q_norm), offset=offset)
        k = rope(self._heads(self.k_proj(x), self.n_kv_heads, self.k_norm), offset=offset)
        return q, k, self._heads(self.v_proj(x), self.n_kv_heads)

    def attend(self, q: mx.array, keys: mx.array, values: mx.array, mask) -> mx.array:
        """SDPA + output projection. q [B, heads, L, D] -> [B, L, H]."""
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        B, _, L, _ = q.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def __call__(self, x: mx.array, ctx: mx.array, cache, rope, masks: dict | None = None) -> mx.array:
        """Inference: x is the block [B, L, H]; ctx holds the new fused context rows [B, S, H]
        (S may be 0), appended to `cache` at their absolute positions. `masks` memoises the
        block masks of one proposal across layers."""
        L = x.shape[1]
        if ctx.shape[1]:
            k_ctx, v_ctx = cache.update_and_fetch(*self.context_kv(ctx, rope, cache.offset))
        else:
            k_ctx, v_ctx = _stored(cache)
        q, k_blk, v_blk = self.block_qkv(x, rope, cache.offset)
        keys = mx.concatenate([k_ctx, k_blk], axis=2)
        values = mx.concatenate([v_ctx, v_blk], axis=2)
        spec = (k_ctx.shape[2], L, self.window, self.causal)
        masks = {} if masks is None else masks
        if spec not in masks:
            masks[spec] = block_attention_mask(*spec)
        return self.attend(q, keys, values, masks[spec])


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig, index: int):
        super().__init__()
        self.self_attn = DraftAttention(c, index)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.is_v2:
            self.attention_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def __call__(self, x, attention):
        """`attention(self_attn, u)` runs the attention sublayer on its (convolved) input, so
        inference (cached context) and training (many blocks, block mask) share this code."""
        if "attention_conv" not in self:
            x = x + attention(self.self_attn, self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))
        u, dyn = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(attention(self.self_attn, u), dyn)
        u, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), dyn)


class Drafter(nn.Module):
    """DFlash (v1) or DFlash 2 drafter. Bind it to a `Target` before use."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [DraftLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.is_v2:
            self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k)
        self.rope = initialize_rope(c.head_dim, base=c.rope_theta, traditional=False,
                                    scaling_config=c.rope_scaling,
                                    max_position_embeddings=c.max_position_embeddings)
        self.target = None
        self.path: str | None = None
        # Optional private head (quantized and/or over the proposal rows); underscores: not parameters.
        self._draft_head = None
        self._head_bits: tuple[int, int] | None = None
        self._proposal_ids: mx.array | None = None
        self.proposal_vocab: ProposalVocab | None = None

    def bind(self, target) -> "Drafter":
        """Share `target`'s embedding and head; fails first if the two do not fit."""
        check_fits(self.config, target.info, fc_width=self._fc_in_features())
        self.target = target
        return self

    def quantize_head(self, bits: int, group_size: int = 64) -> bool:
        """Draft through a private `bits`-bit copy of the target's head (of its proposal rows
        when a proposal vocab is active).

        The drafter reads the full head once per block, which for a small unquantized target is
        a large share of a draft's cost. Verification keeps the target's exact head, so output is
        unchanged; only proposals (and q) may differ slightly. Returns False when the target's
        head is already quantized (nothing to gain). Meant for Apple GPUs: MLX's CPU backend runs
        quantized matmuls slower than dense ones (measured 3x slower drafts on this project's CI).
        """
        if self._require_target().dense_head_weight is None:
            return False
        self._head_bits = (bits, group_size)
        self._build_draft_head()
        return True

    def use_proposal_vocab(self, vocab: ProposalVocab | None) -> None:
        """Propose only among `vocab.ids` (a compact head over those rows); None: the full head.

        Verification and output are unchanged; see `drafter/vocab.py` for why it stays exact.
        """
        if vocab is not None and vocab.vocab_size != self.config.vocab_size:
            raise ConfigError(f"proposal vocab ranks {vocab.vocab_size} ids, the drafter has {self.config.vocab_size}")
        self.proposal_vocab = vocab
        self._proposal_ids = None if vocab is None else vocab.ids
        self._build_draft_head()

    def _build_draft_head(self) -> None:
        if self._proposal_ids is None and self._head_bits is None:
            self._draft_head = None
            return
        bits, group = self._head_bits or (None, 64)
        self._draft_head = head_rows(self._require_target(), self._proposal_ids, bits, group)

    def _fc_in_features(self) -> int:
        w = self.fc.weight
        return w.shape[1] * 32 // self.fc.bits if isinstance(self.fc, nn.QuantizedLinear) else w.shape[1]

    def make_cache(self, reserve: int = 0) -> list:
        """One context K/V store per layer; sliding layers keep `sliding_window - 1 + reserve` rows."""
        return draft_caches(self.config, reserve)

    def begin(self, reserve: int = 0) -> DraftContext:
        """An empty context for a new sequence; `reserve` rows more per sliding layer let a
        prompt cache drop that many tokens exactly once the window is full (rows past the
        window are masked, so drafts are unchanged)."""
        limit = self.config.context_limit
        return DraftContext(self.make_cache(reserve), limit + reserve if limit is not None else None)

    def _require_target(self):
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(target)")
        return self.target

    def fuse_context(self, target_hidden: mx.array) -> mx.array:
        """[B, S, n_taps * H_t] tapped target states -> fused context [B, S, H]."""
        return self.hidden_norm(self.fc(target_hidden))

    def hidden_states(self, block: mx.array, target_hidden: mx.array, cache: list) -> mx.array:
        """Final-normed draft states [B, L, H] for `block [B, L]`; appends the new context rows.

        `target_hidden [B, S, n_taps * H_t]` holds the taps of the S tokens committed since
        the last call; they sit right before the block's anchor.
        """
        target = self._require_target()
        x = target.embed(block)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        ctx = self.fuse_context(target_hidden)
        masks: dict = {}  # layers of one kind share one mask per proposal
        for layer, kv in zip(self.layers, cache):
            x = layer(x, lambda attn, u, kv=kv: attn(u, ctx, kv, self.rope, masks))
        return self.norm(x)

    def logits(self, hidden: mx.array) -> mx.array:
        """Draft logits over the whole vocab through the target's head (or its full quantized
        copy), then the drafter's own transforms."""
        target = self._require_target()
        full_copy = self._draft_head is not None and self._proposal_ids is None
        return self._transform(self._draft_head(hidden) if full_copy else target.head(hidden))

    def proposal_logits(self, hidden: mx.array) -> tuple[mx.array, mx.array | None]:
        """(logits the proposals are drawn from, vocab id of each column or None when all V)."""
        if self._proposal_ids is None:
            return self.logits(hidden), None
        return self._transform(self._draft_head(hidden)), self._proposal_ids

    def _transform(self, out: mx.array) -> mx.array:
        if self.config.output_multiplier != 1.0:
            out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def draft(self, anchor: mx.array, context: DraftContext, block_size: int, temperature: float = 0.0,
              key: mx.array | None = None) -> Proposal:
        """Draft after `anchor [B]` from `context`, which reads (and caches) its pending states."""
        return self.draft_from(anchor, context.take(), context.cache, block_size, temperature, key)

    def draft_from(self, anchor: mx.array, target_hidden: mx.array, cache: list, block_size: int,
                temperature: float = 0.0, key: mx.array | None = None,
                use_kernel: bool | None = None) -> Proposal:
        """Draft `block_size - 1` tokens after `anchor [B]`.

        v2 walks the selector (sampled when temperature > 0, which yields q); v1 proposes the
        argmax of each position (one-hot q at any temperature, the exact choice for a drafter
        whose positions are sampled independently). With a proposal vocab, both draw from its
        ids only.
        """
        B = anchor.shape[0]
        masks = mx.full((B, block_size - 1), self.config.mask_token_id, dtype=anchor.dtype)
        block = mx.concatenate([anchor[:, None], masks], axis=1)
        hidden = self.hidden_states(block, target_hidden, cache)[:, 1:]
        logits, ids = self.proposal_logits(hidden)
        if self.config.is_v2:
            return self.candidate_selector(hidden, logits, anchor, temperature, key, use_kernel, vocab_ids=ids)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        return Proposal(tokens=tokens if ids is None else ids[tokens], logits=logits, vocab_ids=ids)
