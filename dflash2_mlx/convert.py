"""Model conversion: GGUF → MLX, and HF/MLX directory → MLX (re-typed or quantized).

GGUF (llama, qwen2, qwen3, gemma3), torch-free:
* every tensor is dequantized with `gguf.quants.dequantize`, so the float output holds exactly
  the values the GGUF encodes (float32 keeps them exact; bfloat16/float16 round them);
* names map to the Hugging Face layout mlx-lm loads;
* llama: llama.cpp permutes the rows of `attn_q`/`attn_k` for its interleaved RoPE; we undo it;
* gemma3: llama.cpp stores every RMSNorm weight as `1 + w`; mlx-lm adds the 1 itself, so we
  subtract it;
* config.json comes from the GGUF metadata (plus llama.cpp's own gemma3 constants), and the
  tokenizer from transformers' torch-free GGUF tokenizer builders;
* `q_bits` quantizes each matrix with MLX while streaming (no float copy on disk), with the
  predicate mlx-lm uses: Linear and Embedding weights whose last axis divides the group size.

HF/MLX directories go through mlx-lm's own `convert` (load lazily, cast, quantize, save).
Output directories appear atomically: work happens in a sibling temp directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import ConfigError
from .paths import atomic_path
from .progress import bar

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 5 * 10**9

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_NORM_PARTS = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_ARCH_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Tensors that carry config rather than weights (llama 3.x RoPE factors).
_CONSUMED = {"rope_freqs.weight"}
# llama.cpp pre-tokenizers transformers does not map; SmolLM splits digits one by one.
_EXTRA_PRE_TOKENIZERS = {"smollm"}


# -- reading ----------------------------------------------------------------------------


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in NumPy (row-major, HF) order."""
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape.tolist())]
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The HF tensor name for a GGUF tensor; None for tensors folded into the config."""
    if gguf_name in _CONSUMED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", gguf_name)
    part = m and (_BLOCK_PARTS.get(m.group(2)) or _NORM_PARTS[arch].get(m.group(2)))
    if not part:
        raise ConfigError(f"GGUF tensor {gguf_name!r} has no {arch} counterpart; this file is not supported")
    return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (per head: [pairs, 2] -> [2, pairs]).

    llama.cpp reorders each head's rows from HF's rotate-half layout (first half, second half)
    to interleaved pairs for its RoPE; K uses the KV head count.
    """
    pairs = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, pairs, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(params: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for llama3 RoPE scaling (as its converter computes them)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, low, high, factor = (params["original_max_position_embeddings"], params["low_freq_factor"],
                              params["high_freq_factor"], params["factor"])
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _rope_scaling(reader, arch: str, theta: float, head_dim: int, names: dict) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        out = {"type": kind, "rope_type": kind, "factor": float(factor)}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            out["original_max_position_embeddings"] = int(original)
        return out
    if kind not in (None, "none"):
        raise ConfigError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn, llama3)")
    if "rope_freqs.weight" not in names:
        return None
    factors = dequantized(names["rope_freqs.weight"]).reshape(-1).astype(np.float64)
    params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(_llama3_factors(params, theta, head_dim), factors, rtol=1e-4):
        raise ConfigError("GGUF rope_freqs do not match llama3 scaling with factor "
                          f"{params['factor']}, low 1, high 4, original context 8192; not supported")
    return params


def gguf_config(reader, arch: str) -> dict:
    """An mlx-lm / HF `config.json` for a GGUF's model, from its metadata."""
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    names = {t.name: t for t in reader.tensors}

    def g(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    n_heads, hidden, n_layers = int(g("attention.head_count")), int(g("embedding_length")), int(g("block_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    theta = float(g("rope.freq_base", 10000.0))
    model_type, cls = _ARCH_CLASSES[arch]
    cfg = dict(
        architectures=[cls], model_type=model_type,
        hidden_size=hidden, intermediate_size=int(g("feed_forward_length")), num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")), rope_theta=theta,
        max_position_embeddings=int(g("context_length")),
        vocab_size=int(names["token_embd.weight"].shape[-1]),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_eos_ids(reader),
    )
    scaling = _rope_scaling(reader, arch, theta, head_dim, names)
    if scaling:
        cfg["rope_scaling"] = scaling
    if arch == "llama":
        cfg.update(hidden_act="silu", attention_bias="blk.0.attn_q.bias" in names, mlp_bias=False)
    elif arch in ("qwen2", "qwen3"):
        cfg.update(hidden_act="silu", use_sliding_window=False)
    elif arch == "gemma3":
        pattern = 6  # llama.cpp hard-codes 5 local : 1 global layers for gemma3
        # llama.cpp: the 27B model (62 layers) scales queries by hidden/heads, the others by head_dim.
        scalar = hidden // n_heads if n_layers == 62 else head_dim
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                   sliding_window=int(g("attention.sliding_window", 512)), sliding_window_pattern=pattern,
                   layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(n_layers)],
                   rope_local_base_freq=10000.0, tie_word_embeddings=True)
    return cfg


# Bumped when a conversion's output changes, so cached conversions are redone (2: stop ids).
CONVERTER_VERSION = 2

# Token texts llama.cpp ends generation on whatever the metadata says: Qwen2.5's GGUFs name only
# <|im_end|> as EOS, while its upstream generation_config also stops on <|endoftext|>.
_END_OF_GENERATION_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"))


def _eos_ids(reader) -> int | list[int] | None:
    """The ids generation stops on: the metadata's EOS/EOT/EOM, then the end-of-generation texts."""
    ids = [_field(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    ids += [i for i, text in enumerate(tokens) if text in _END_OF_GENERATION_TEXTS]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def hf_tensors(reader, arch: str, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every weight of the GGUF, with the per-family fixes."""
    for tensor in reader.tensors:
        name = hf_name(arch, tensor.name)
        if name is None:
            continue
        w = dequantized(tensor)
        if arch == "llama" and re.search(r"\.attn_[qk]\.(weight|bias)$", tensor.name):
            heads = config["num_attention_heads"] if ".attn_q." in tensor.name else config["num_key_value_heads"]
            w = unpermute_qk(w, heads)
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            w = w - 1.0
        yield name, w


# -- tokenizer --------------------------------------------------------------------------


def build_tokenizer(reader, arch: str):
    """A `PreTrainedTokenizerFast` from the GGUF's tokenizer metadata (no torch needed)."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x keeps the builders elsewhere
        from transformers.integrations.ggml import convert_gguf_tokenizer

    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ConfigError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    spec = {"tokens": tokens}
    for key, name in (("model", "tokenizer_type"), ("pre", "pre_tokenizer_type"), ("scores", "scores"),
                      ("token_type", "token_type"), ("merges", "merges"), ("add_space_prefix", "add_prefix_space")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            spec[name] = list(value) if isinstance(value, (list, tuple)) else value
    try:
        backend, _ = convert_gguf_tokenizer(arch, spec)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"cannot build the GGUF tokenizer ({spec.get('tokenizer_type')!r}): {e}") from e
    if spec.get("pre_tokenizer_type") in _EXTRA_PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])

    def special(key):
        index = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    kwargs = {"bos_token": special("bos_token_id"), "eos_token": special("eos_token_id"),
              "unk_token": special("unknown_token_id"), "pad_token": special("padding_token_id"),
              "chat_template": _field(reader, "tokenizer.chat_template")}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in kwargs.items() if v is not None})


def _save_tokenizer(tokenizer, reader, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        config["add_bos_token"] = bool(add_bos)
    # A class name transformers 4.x and 5.x both resolve (5.x writes "TokenizersBackend").
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


# -- writing ----------------------------------------------------------------------------


def _quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """mlx-lm's default predicate: Linear and Embedding weights whose width divides into groups."""
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % group_size == 0


def _output_tensors(arrays: Iterator[tuple[str, np.ndarray]], dtype: str, q_bits: int | None, group_size: int):
    import mlx.core as mx

    for name, w in arrays:
        arr = mx.array(w).astype(getattr(mx, dtype))
        if q_bits and _quantizable(name, w.shape, group_size):
            wq, scales, biases = mx.quantize(arr, group_size=group_size, bits=q_bits)
            stem = name[: -len(".weight")]
            yield {name: wq, f"{stem}.scales": scales, f"{stem}.biases": biases}, w.nbytes
        else:
            yield {name: arr}, w.nbytes


def _write_shards(groups, out: Path, total_bytes: int, progress: bool) -> None:
    """Write tensor groups to `model.safetensors` (or shards + index), <= SHARD_BYTES each.

    Each shard is saved as soon as it is full, so memory holds one shard, not the model.
    """
    import mlx.core as mx

    written: list[tuple[Path, list[str], int]] = []
    shard: dict = {}
    size = 0

    def flush():
        path = out / f".shard-{len(written)}.safetensors"
        mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
        written.append((path, list(shard), size))

    with bar("converting", total_bytes, enabled=progress, unit="B") as advance:
        for tensors, src_bytes in groups:
            nbytes = sum(a.nbytes for a in tensors.values())
            if shard and size + nbytes > SHARD_BYTES:
                flush()
                shard, size = {}, 0
            mx.eval(list(tensors.values()))
            shard.update(tensors)
            size += nbytes
            advance(src_bytes)
    flush()
    n = len(written)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, (path, keys, _) in zip(names, written):
        os.replace(path, out / name)
        weight_map.update({k: name for k in keys})
    if n > 1:
        index = {"metadata": {"total_size": sum(s for *_, s in written)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@contextlib.contextmanager
def _atomic_dir(out: Path, overwrite: bool):
    """Yields a temp dir next to `out`; on success it becomes `out`."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"output {str(out)!r} already exists; choose a new directory or pass --overwrite")
    with atomic_path(out) as tmp:
        tmp.mkdir()
        yield tmp


def _check_options(dtype: str, q_bits: int | None, group_size: int) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if q_bits not in (None, 4, 8):
        raise ConfigError(f"quantization bits must be 4 or 8, got {q_bits}")
    if group_size not in (32, 64, 128):
        raise ConfigError(f"group size must be 32, 64 or 128, got {group_size}")


@dataclass
class GGUFSummary:
    arch: str
    name: str | None
    n_tensors: int
    n_params: int
    file_types: dict[str, int]


def inspect_gguf(path) -> GGUFSummary:
    """What a GGUF holds, without dequantizing anything."""
    reader = _open(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFSummary(arch=str(_field(reader, "general.architecture")), name=_field(reader, "general.name"),
                       n_tensors=len(reader.tensors), n_params=int(sum(int(t.n_elements) for t in reader.tensors)),
                       file_types=types)


def _open(path):
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file {str(path)!r} does not exist")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def convert_gguf(src, out, dtype: str = "bfloat16", q_bits: int | None = None, group_size: int = 64,
                 overwrite: bool = False, progress: bool = True) -> Path:
    """Convert a GGUF file into an mlx-lm model directory.

    Args:
        dtype: float type of the output (and of the scales when quantizing); "float32" keeps
            the dequantized GGUF values exactly.
        q_bits: 4 or 8 to quantize matrices with MLX (affine, `group_size`); None keeps floats.
        overwrite: replace `out` if it exists (default: refuse).
    Returns:
        `out` as a Path.
    Raises:
        ConfigError: unreadable file, unsupported architecture or tensor, bad options.
    """
    _check_options(dtype, q_bits, group_size)
    reader = _open(src)
    arch = str(_field(reader, "general.architecture"))
    config = gguf_config(reader, arch)
    tokenizer = build_tokenizer(reader, arch)
    total = sum(int(t.n_elements) * 4 for t in reader.tensors if t.name not in _CONSUMED)
    out = Path(out)
    with _atomic_dir(out, overwrite) as tmp:
        tensors = _output_tensors(hf_tensors(reader, arch, config), dtype, q_bits, group_size)
        _write_shards(tensors, tmp, total, progress)
        config["torch_dtype"] = dtype
        if q_bits:
            quant = {"group_size": group_size, "bits": q_bits, "mode": "affine"}
            config["quantization"] = quant
            config["quantization_config"] = dict(quant)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _save_tokenizer(tokenizer, reader, tmp)
        (tmp / "dflash2-source.json").write_text(json.dumps(
            {"source": str(Path(src).resolve()), "format": "gguf", "converter": CONVERTER_VERSION, "arch": arch,
             "dtype": dtype, "q_bits": q_bits, "group_size": group_size if q_bits else None}, indent=2))
    log.info("converted %s (%s) -> %s", src, arch, out)
    return out


def convert_hf(src, out, q_bits: int | None = 4, group_size: int = 64, dtype: str | None = None,
               overwrite: bool = False) -> Path:
    """Re-type and/or quantize an HF or MLX model directory with mlx-lm's converter.

    Args:
        src: a local model directory (resolve repo ids with `hub` first).
        q_bits: 4 or 8 to quantize; None only casts to `dtype`.
        dtype: float type of unquantized weights and scales; None keeps the model's own.
    """
    _check_options(dtype or "bfloat16", q_bits, group_size)
    src = Path(src)
    if not (src / "config.json").is_file():
        raise ConfigError(f"{str(src)!r} is not a model directory (no config.json)")
    if q_bits and "quantization" in json.loads((src / "config.json").read_text()):
        raise ConfigError(f"{str(src)!r} is already quantized; convert its float original instead")
    from mlx_lm.convert import convert as mlx_lm_convert

    out = Path(out)
    with _atomic_dir(out, overwrite) as tmp:
        target = tmp / "model"  # mlx-lm insists on creating the directory itself
        with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints progress to stdout
            mlx_lm_convert(str(src), str(target), quantize=q_bits is not None, q_bits=q_bits,
                           q_group_size=group_size, dtype=dtype)
        for item in target.iterdir():
            os.replace(item, tmp / item.name)
        target.rmdir()
    return out


def convert(src, out, q_bits: int | None = None, group_size: int = 64, dtype: str | None = None,
            overwrite: bool = False, progress: bool = True) -> Path:
    """GGUF file → `convert_gguf`; model directory → `convert_hf`."""
    if str(src).lower().endswith(".gguf"):
        return convert_gguf(src, out, dtype=dtype or "bfloat16", q_bits=q_bits, group_size=group_size,
                            overwrite=overwrite, progress=progress)
    return convert_hf(src, out, q_bits=q_bits, group_size=group_size, dtype=dtype, overwrite=overwrite)
