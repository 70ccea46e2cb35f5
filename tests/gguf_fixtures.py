"""Tiny random models in HF layout, written to GGUF files the way llama.cpp's converter does.

This module encodes llama.cpp's conventions independently of `dflash2_mlx.convert`:
names (`blk.N.attn_q` ...), the llama Q/K row permutation (`LlamaModel.permute`), gemma's
`1 + w` norm storage, and a tiny byte-level BPE tokenizer in GGUF metadata.
"""

from __future__ import annotations

import importlib

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from tiny import FAMILIES

# 256 byte-level symbols + 3 merges + 2 control tokens
MERGES = ["Ġ t", "h e", "Ġt he"]
_EXTRA = ["Ġt", "he", "Ġthe", "<s>", "</s>"]
VOCAB = 256 + len(_EXTRA)

_BASE = {k: v for k, v in FAMILIES["llama"].items() if k != "model_type"}
CONFIGS = {
    "llama": dict(_BASE, model_type="llama", vocab_size=VOCAB, tie_word_embeddings=False),
    "qwen2": dict(_BASE, model_type="qwen2", vocab_size=VOCAB, tie_word_embeddings=False, head_dim=16),
    "qwen3": dict(_BASE, model_type="qwen3", vocab_size=VOCAB, tie_word_embeddings=True),
    # pattern 6 (what llama.cpp assumes), 6 layers, window 4 < the test prompts, distinct RoPE bases
    "gemma3": dict(_BASE, model_type="gemma3_text", vocab_size=VOCAB, num_hidden_layers=6, sliding_window=4,
                   sliding_window_pattern=6, query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4,
                   tie_word_embeddings=True),
}
MODULES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_NORMS = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen2": {"post_attention_layernorm": "ffn_norm"},
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random mlx-lm model of `arch` (HF parameter names), float32, logits far from flat."""
    config = dict(CONFIGS[arch], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{MODULES[arch]}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if arch == "gemma3":
        model.sanitize({})  # a tied checkpoint: drops lm_head, as loading one does
    mx.random.seed(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            p = mx.random.normal(p.shape) * 0.2
        elif name.endswith("bias"):
            p = mx.random.normal(p.shape) * 0.1
        else:  # norms: away from 1 so a missed `1 + w` shift shows
            p = 1.0 + mx.random.normal(p.shape) * 0.3
        params.append((name, p.astype(mx.float32)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model, config


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp `LlamaModel.permute` (convert_hf_to_gguf.py), verbatim in NumPy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(arch: str, model, config: dict) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names and in llama.cpp's stored form."""
    out = {}
    for name, p in tree_flatten(model.parameters()):
        w = np.array(p, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            key = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            key = f"blk.{i}.{(_PARTS | _NORMS[arch])[part]}.{kind}"
        if arch == "llama" and ".attn_q." in key:
            w = llama_cpp_permute(w, config["num_attention_heads"], config["num_attention_heads"])
        if arch == "llama" and ".attn_k." in key:
            w = llama_cpp_permute(w, config["num_attention_heads"], config["num_key_value_heads"])
        if arch == "gemma3" and key.endswith("norm.weight"):
            w = w + 1.0
        out[key] = w
    return out


def write_gguf(path, arch: str, model, config: dict, qtype=None, extra_tensors: dict | None = None,
               metadata=None, specials=("<s>", "</s>")) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF; 2-D weights quantized to `qtype` (e.g. Q8_0) when given.

    `specials` are the texts of the last two tokens: BOS and EOS.

    Returns the float tensors as stored (before quantization), by GGUF name.
    """
    tensors = gguf_tensors(arch, model, config)
    tensors.update(extra_tensors or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + _EXTRA[:-2] + list(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key, value in (metadata or {}).items():
        getattr(w, key)(value)
    for name, t in tensors.items():
        if qtype is not None and t.ndim == 2:
            q = gguf.quants.quantize(t, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors
