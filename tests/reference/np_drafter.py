"""Float64 NumPy reference of the DFlash / DFlash 2 drafter forward (one block, full context).

Written from the algorithm description (DESIGN.md, dflash-algorithm.md §1.2, §1.5, §2.3), not
from our MLX code: KV injection of the fused context, RoPE at absolute positions (half-split
rotation), sliding-window context, bidirectional or causal in-block attention, the two-tap
grouped dynamic convolution around both sublayers, final norm.
"""

from __future__ import annotations

import numpy as np

from .np_ops import grouped_dynamic_conv


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [n, heads, d] at integer positions [n]; rotates (x[:d/2], x[d/2:]) pairs."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2) / d)
    angles = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def silu(x):
    return x / (1 + np.exp(-x))


def attention(p, prefix, h, c, cfg, layer, start):
    """h: block rows [L, H] (after norm/conv); c: fused context [S, H] at positions 0..S-1."""
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, L, S = cfg.rms_norm_eps, h.shape[0], c.shape[0]

    def proj(x, name, heads, norm=None):
        y = (x @ p[f"{prefix}.self_attn.{name}_proj.weight"].T).reshape(x.shape[0], heads, d)
        return rms_norm(y, p[f"{prefix}.self_attn.{norm}_norm.weight"], eps) if norm else y

    q = rope(proj(h, "q", nh, "q"), start + np.arange(L), cfg.rope_theta)
    k = np.concatenate([rope(proj(c, "k", nkv, "k"), np.arange(S), cfg.rope_theta),
                        rope(proj(h, "k", nkv, "k"), start + np.arange(L), cfg.rope_theta)])
    v = np.concatenate([proj(c, "v", nkv), proj(h, "v", nkv)])
    key_pos = np.concatenate([np.arange(S), start + np.arange(L)])
    window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
    out = np.zeros((L, nh, d))
    for i in range(L):
        q_pos = start + i
        visible = np.ones(S + L, dtype=bool)
        if window is not None:
            visible[:S] = q_pos - key_pos[:S] < window
        if cfg.causal[layer]:
            visible[S:] = np.arange(L) <= i
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = k[:, kv] @ q[i, head] * d**-0.5
            scores = np.where(visible, scores, -np.inf)
            w = np.exp(scores - scores.max())
            out[i, head] = (w / w.sum()) @ v[:, kv]
    return out.reshape(L, nh * d) @ p[f"{prefix}.self_attn.o_proj.weight"].T


def mlp(p, prefix, x):
    g, u = x @ p[f"{prefix}.mlp.gate_proj.weight"].T, x @ p[f"{prefix}.mlp.up_proj.weight"].T
    return (silu(g) * u) @ p[f"{prefix}.mlp.down_proj.weight"].T


def drafter_forward(p, cfg, block, ctx_hidden, embed, embed_scale=1.0):
    """Final-normed draft states [L, H] for block ids [L] after context taps [S, n*H_t]."""
    eps = cfg.rms_norm_eps
    x = embed[block] * embed_scale * cfg.input_embedding_scale
    c = rms_norm(ctx_hidden @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    start = ctx_hidden.shape[0]
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}"
        for sub, norm, conv in (("attn", "input_layernorm", "attention_conv"),
                                ("mlp", "post_attention_layernorm", "mlp_conv")):
            h = rms_norm(x, p[f"{pre}.{norm}.weight"], eps)
            if cfg.is_v2:
                G, K = cfg.conv_group_size, cfg.conv_kernel_size
                dyn = (h @ p[f"{pre}.{conv}.kernel_projection.weight"].T).reshape(len(h), 2, K, -1)
                base = p[f"{pre}.{conv}.base_kernel"]
                h = grouped_dynamic_conv(h, dyn[:, 0], base[0], G)
            y = attention(p, pre, h, c, cfg, i, start) if sub == "attn" else mlp(p, pre, h)
            if cfg.is_v2:
                y = grouped_dynamic_conv(y, dyn[:, 1], base[1], G)
            x = x + y
    return rms_norm(x, p["norm.weight"], eps)
