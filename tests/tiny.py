"""Tiny random models, a tiny tokenizer and tiny drafters, built in memory for tests.

Vocab 97 (a prime: catches code that assumes multiples of 32), hidden 64, 4 layers.
Weights come from fixed seeds and are scaled so logits are far from flat.
"""

from __future__ import annotations

import importlib
import string

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dflash2_mlx.drafter.config import parse_config
from dflash2_mlx.drafter.model import Drafter
from dflash2_mlx.target import Target

VOCAB = 97
HIDDEN = 64
MASK_ID = 96

_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)

FAMILIES = {
    "llama": dict(_BASE, model_type="llama"),
    "qwen3": dict(_BASE, model_type="qwen3"),
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(_BASE, model_type="qwen3_5_text", linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         full_attention_interval=2,
                         rope_parameters={"type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
    ),
    # window 8 so that generations of a few dozen tokens wrap the ring many times
    "gemma3_text": dict(_BASE, model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=16, rope_local_base_freq=10000.0, tie_word_embeddings=True),
}


class TinyTokenizer:
    """Character-level tokenizer with mlx-lm's wrapper (for detokenizing and EOS).

    `byte_level=True` spells space and newline the GPT-2 byte-level way (Ġ, Ċ) with a
    ByteLevel decoder, as grammar libraries (llguidance) expect of a tokenizer.
    """

    @staticmethod
    def make(byte_level: bool = False, added: dict[int, str] | None = None, wrap: bool = True):
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        chars = list(string.ascii_letters + string.digits + " .,!?;:'\"()-+=*/\n")
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
        spell = {" ": "\u0120", "\n": "\u010a"} if byte_level else {}
        for ch in chars:
            vocab.setdefault(spell.get(ch, ch), len(vocab))
        extra = "{}[]_" if byte_level else ""  # JSON needs braces; they take placeholder ids
        added = added or {}
        for i in range(len(vocab), VOCAB):
            vocab[extra[i - len(chars) - 3] if i - len(chars) - 3 < len(extra) else added.get(i, f"<x{i}>")] = i
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        if added:  # whole-word tokens, matched before the per-character split
            from tokenizers import AddedToken

            tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added.values()])
        if byte_level:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False),
                                                         pre_tokenizers.Split("", "isolated")])
            tok.decoder = decoders.ByteLevel()
        else:
            tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
            tok.decoder = decoders.Fuse()
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        return TokenizerWrapper(hf) if wrap else hf


def _scale_weights(model: nn.Module, seed: int, std: float = 0.08) -> None:
    mx.random.seed(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2 and mx.issubdtype(p.dtype, mx.floating):
            p = mx.random.normal(p.shape) * std
        params.append((name, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def tiny_model(family: str, seed: int = 0, **overrides) -> nn.Module:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    config = dict(FAMILIES[family], **overrides)
    # Seed before building too: qwen3_5 draws A_log at construction and it is not rescaled below.
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    if family == "gemma3_text":
        model.sanitize({})  # ties the head to the embedding, as loading a tied checkpoint does
    # Scales chosen so that greedy outputs stay diverse (random nets collapse to loops otherwise).
    _scale_weights(model, seed, std=0.08 if family == "gemma3_text" else 0.25)
    model.set_dtype(mx.float32)
    return model


def tiny_target(family: str = "llama", seed: int = 0, fast_recurrent_replay: bool = True,
                eos: tuple[int, ...] = (), stacked_replay: bool = True, byte_level: bool = False,
                **overrides) -> Target:
    """A tiny target; no EOS by default so generations run to max_tokens."""
    tokenizer = TinyTokenizer.make(byte_level)
    tokenizer._eos_token_ids = set(eos)
    return Target(tiny_model(family, seed, **overrides), tokenizer, path=f"tiny-{family}",
                  fast_recurrent_replay=fast_recurrent_replay, stacked_replay=stacked_replay)


def drafter_config_dict(arch: str = "dflash2", block_size: int = 8, layer_types=None, sliding_window=16,
                        target_layers=(0, 2, 3), n_target_layers=4, is_causal=False, rank=16, top_k=8,
                        vocab_size=VOCAB) -> dict:
    n_layers = len(layer_types) if layer_types else 2
    cfg = {
        "architectures": [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[arch]],
        "model_type": "qwen3", "hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": n_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "layer_types": list(layer_types or ["sliding_attention"] * n_layers), "sliding_window": sliding_window,
        "is_causal": is_causal, "tie_word_embeddings": False, "num_target_layers": n_target_layers,
        "dflash_config": {"block_size": block_size, "mask_token_id": MASK_ID, "target_layer_ids": list(target_layers)},
    }
    if arch == "dflash2":
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=rank, selector_top_k=top_k)
    return cfg


def tiny_drafter(target: Target | None, arch: str = "dflash2", seed: int = 1, identity_conv: bool = False,
                 **config_kwargs) -> Drafter:
    drafter = Drafter(parse_config(drafter_config_dict(arch, **config_kwargs)))
    _scale_weights(drafter, seed, std=0.15)
    if arch == "dflash2" and not identity_conv:
        params = []
        for name, p in tree_flatten(drafter.parameters()):
            if name.endswith("base_kernel"):
                p = mx.random.normal(p.shape) * 0.3 + mx.array([1.0, 0.0])[None, :, None]
            params.append((name, p))
        drafter.update(tree_unflatten(params))
    elif arch == "dflash2":
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0, :].add(1.0)
                conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    drafter.set_dtype(mx.float32)
    mx.eval(drafter.parameters())
    if target is not None:
        drafter.bind(target)
    return drafter


def save_tiny_pair(root, family: str = "llama", arch: str = "dflash2", seed: int = 0, byte_level: bool = False,
                   target_overrides: dict | None = None, **drafter_kwargs):
    """Write a tiny target (mlx-lm layout) and a tiny drafter (published layout) under `root`.

    Returns (target_dir, drafter_dir); both load with `load_target` / `load_drafter` and the CLI.
    """
    import json
    from pathlib import Path

    from mlx_lm.utils import save_model

    from dflash2_mlx.drafter.load import save_drafter

    root = Path(root)
    target_dir, drafter_dir = root / f"tiny-{family}", root / f"tiny-{family}-{arch}"
    model = tiny_model(family, seed, **(target_overrides or {}))
    target_dir.mkdir(parents=True, exist_ok=True)
    save_model(target_dir, model)
    (target_dir / "config.json").write_text(json.dumps(dict(FAMILIES[family], **(target_overrides or {}))))
    TinyTokenizer.make(byte_level)._tokenizer.save_pretrained(str(target_dir))
    save_drafter(tiny_drafter(None, arch, **drafter_kwargs), drafter_dir)
    return target_dir, drafter_dir
