"""New drafters for a target: config from the target's shape, identity convs, v1 → v2 upgrade."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from ..drafter.config import DrafterConfig, parse_config
from ..drafter.model import Drafter
from ..errors import ConfigError

MASK_TOKEN_NAMES = ("<|MASK|>", "<mask>", "<|mask|>", "[MASK]")


def default_target_layer_ids(n_layers: int, n_taps: int) -> list[int]:
    """Upstream's spread of taps: one tap in the middle, else round(1 + i (L-4) / (n-1))."""
    if n_taps == 1:
        return [n_layers // 2]
    return [round(1 + i * (n_layers - 4) / (n_taps - 1)) for i in range(n_taps)]


def find_mask_token(tokenizer) -> int | None:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return next((vocab[name] for name in MASK_TOKEN_NAMES if name in vocab), None)


def new_config(target, arch: str = "dflash2", n_layers: int = 2, block_size: int = 8, n_taps: int = 5,
               target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
               sliding_window: int = 2048, intermediate_size: int | None = None, selector_rank: int = 64,
               selector_top_k: int = 16) -> DrafterConfig:
    """A drafter config shaped like the target (hidden size, heads, head dim, RoPE base)."""
    args = target.args
    if mask_token_id is None:
        mask_token_id = find_mask_token(target.tokenizer)
    if mask_token_id is None:
        raise ConfigError("the target tokenizer has no mask token; pass mask_token_id (an id rarely used in text)")
    ids = target_layer_ids or default_target_layer_ids(target.n_layers, n_taps)
    heads = int(getattr(args, "num_attention_heads"))
    hidden = target.hidden_size
    cfg = {
        "architectures": ["DFlash2DraftModel" if arch == "dflash2" else "DFlashDraftModel"],
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or getattr(args, "intermediate_size", 4 * hidden)),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(args, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(args, "head_dim", None) or hidden // heads),
        "rms_norm_eps": float(getattr(args, "rms_norm_eps", 1e-6)),
        "vocab_size": target.info.vocab_size,
        "max_position_embeddings": int(getattr(args, "max_position_embeddings", 32768)),
        "rope_parameters": {"rope_theta": float(getattr(args, "rope_theta", 10000.0)), "rope_type": "default"},
        "layer_types": ["sliding_attention"] * n_layers,
        "sliding_window": sliding_window,
        "is_causal": False,
        "num_target_layers": target.n_layers,
        "dflash_config": {"block_size": block_size, "mask_token_id": int(mask_token_id), "target_layer_ids": ids},
    }
    if arch == "dflash2":
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=selector_rank,
                                    selector_top_k=selector_top_k)
    elif arch != "dflash":
        raise ConfigError(f"arch must be 'dflash2' or 'dflash', got {arch!r}")
    return parse_config(cfg)


def new_drafter(config: DrafterConfig, seed: int = 0) -> Drafter:
    """Randomly initialised drafter (convs at identity); deterministic given `seed`."""
    mx.random.seed(seed)
    drafter = Drafter(config)
    mx.eval(drafter.parameters())
    return drafter


def upgrade_to_v2(v1: Drafter, selector_rank: int = 64, selector_top_k: int = 16, seed: int = 0) -> Drafter:
    """A DFlash 2 drafter with `v1`'s backbone copied, convs at identity and a fresh selector."""
    c = v1.config
    if c.is_v2:
        raise ConfigError("the drafter to upgrade is already DFlash 2")
    fields = c.to_dict() | dict(arch="dflash2", conv_kernel_size=2, conv_group_size=16,
                                selector_rank=selector_rank, selector_top_k=selector_top_k)
    v2 = new_drafter(DrafterConfig(**fields), seed)
    ours = dict(tree_flatten(v1.parameters()))
    v2.load_weights(list(ours.items()), strict=False)
    mx.eval(v2.parameters())
    return v2
