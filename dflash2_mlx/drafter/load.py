"""Drafter checkpoints: read (with remaps and strict checks), quantize, and write.

The published layout (dflash-algorithm.md §1.8, §2.2) is `config.json` + `*.safetensors`.
Remaps, each a quirk of a published format:
* DFlash 2 stores the selector codebooks without `.weight`; our `nn.Embedding` wants it.
* Meta's assistant (v1) names the fusion `encoder.fc` and `encoder.output_norm_enc`.
Loading is strict: a missing, unexpected or mis-shaped tensor is an error listing names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ConfigError, WeightsError
from ..paths import atomic_path
from .config import DrafterConfig, check_fits, parse_config
from .model import Drafter
from .vocab import resolve_vocab

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
_MUSE_RENAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
_ARCH_NAMES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "muse": "MuseGlimmerAssistantModel"}


def sanitize(weights: dict[str, mx.array], config: DrafterConfig) -> dict[str, mx.array]:
    """Checkpoint tensor names -> our parameter names (see module docstring)."""
    out = {}
    for name, value in weights.items():
        if config.arch == "muse":
            for old, new in _MUSE_RENAMES.items():
                if name.startswith(old):
                    name = new + name[len(old):]
        if name in _CODEBOOKS:
            name = name + ".weight"
        out[name] = value
    return out


def unsanitize(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Our parameter names -> the published DFlash 2 layout (codebooks without `.weight`)."""
    return {(k[: -len(".weight")] if k[: -len(".weight")] in _CODEBOOKS else k): v for k, v in params.items()}


def read_checkpoint(path: Path) -> tuple[dict, dict[str, mx.array]]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ConfigError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no *.safetensors files")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return json.loads(config_file.read_text()), weights


def _check_tensors(model: Drafter, weights: dict[str, mx.array]) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(
        f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if problems:
        raise WeightsError("drafter checkpoint does not match its config: " + "; ".join(problems))


def quantize_drafter(model: Drafter, bits: int, group_size: int = 64) -> None:
    """Quantize every Linear/Embedding whose input width allows it (like `--draft-bits`)."""
    if bits not in (4, 8):
        raise ConfigError(f"draft_bits must be 4 or 8, got {bits}")

    def predicate(_, module):
        return isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)


def build_drafter(config: DrafterConfig, weights: dict[str, mx.array], target=None,
                  draft_bits: int | None = None, dtype: str | None = None) -> Drafter:
    """Validate against `target` (if given), load weights strictly, quantize, bind.

    With no `dtype`, a bound drafter computes in the target's activation dtype (a bf16 file on
    a float32 target is upcast: mixed-dtype matmuls are slow, and the states it reads are fp32).
    """
    weights = sanitize(weights, config)
    if target is not None:
        fc = weights.get("fc.weight")
        check_fits(config, target.info, fc_width=None if fc is None else fc.shape[1])
    model = Drafter(config)
    _check_tensors(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is None and target is not None:
        dtype = target.activation_dtype
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype) if isinstance(dtype, str) else dtype)
    if draft_bits:
        quantize_drafter(model, draft_bits)
    mx.eval(model.parameters())
    model.eval()
    if target is not None:
        model.bind(target)
    return model


def load_drafter(path, target=None, draft_bits: int | None = None, dtype: str | None = None,
                 head_bits: int | None = None, draft_vocab: int | None = None) -> Drafter:
    """Load the DFlash / DFlash 2 drafter in the local directory `path` and bind it to `target`
    (`hub.load_drafter` takes a shipped name or a Hugging Face repo id too).

    Args:
        draft_bits: quantize the drafter to 4 or 8 bits after loading.
        dtype: cast its weights ("float32", "bfloat16", "float16").
        head_bits: draft through a private 4- or 8-bit copy of the target's head (see
            `Drafter.quantize_head`); needs `target`.
        draft_vocab: propose among the top N ids of the drafter's `proposal_vocab.json`
            (None: the file's default size when the file is there; 0: the full head).
    Raises:
        ConfigError, WeightsError, IncompatibleDrafterError.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"drafter directory {path} does not exist (hub.load_drafter resolves names and repo ids)")
    raw, weights = read_checkpoint(path)
    model = build_drafter(parse_config(raw), weights, target, draft_bits, dtype)
    model.path = str(path)
    if head_bits:
        if head_bits not in (4, 8) or target is None:
            raise ConfigError(f"head_bits must be 4 or 8 with a target, got {head_bits}")
        model.quantize_head(head_bits)
    vocab = resolve_vocab(path, model.config.vocab_size, draft_vocab)
    if vocab is not None and target is not None:
        model.use_proposal_vocab(vocab)
    return model


def published_config(config: DrafterConfig, extra: dict | None = None) -> dict:
    """`config.json` content in the current published schema for `config`."""
    c = config
    dflash = {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
              "target_layer_ids": list(c.target_layer_ids)}
    if c.is_v2:
        dflash.update(conv_group_size=c.conv_group_size, conv_kernel_size=c.conv_kernel_size,
                      selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    if c.final_logit_softcapping:
        dflash["final_logit_softcapping"] = c.final_logit_softcapping
    if c.output_multiplier != 1.0:
        dflash["output_multiplier"] = c.output_multiplier
    if c.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = c.input_embedding_scale
    rope = dict(c.rope_scaling or {"rope_type": "default"})
    rope["rope_theta"] = c.rope_theta
    out = {
        "architectures": [_ARCH_NAMES[c.arch]],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": rope,
        "layer_types": list(c.layer_types),
        "is_causal": bool(c.causal[0]) if len(set(c.causal)) == 1 else None,
        "tie_word_embeddings": False,
        "num_target_layers": c.num_target_layers,
        "dflash_config": dflash,
    }
    if c.sliding_window:
        out["sliding_window"] = c.sliding_window
    if out["is_causal"] is None:
        del out["is_causal"]
    out.update(_interop_fields(c))
    out.update(extra or {})
    if "torch_dtype" in out:
        out.setdefault("dtype", out["torch_dtype"])  # transformers >= 4.56 reads `dtype`
    return out


def _interop_fields(c: DrafterConfig) -> dict:
    """Fields the GPU servers and converters read (interop.md §1): without `use_sliding_window`
    transformers' Qwen3 config drops `sliding_window` and SGLang / vLLM refuse sliding layers;
    llama.cpp's converter and exo read the top-level `block_size` / `rope_theta`."""
    sliding = [i for i, t in enumerate(c.layer_types) if t == "sliding_attention"]
    return {"use_sliding_window": bool(sliding), "max_window_layers": sliding[0] if sliding else c.num_hidden_layers,
            "block_size": c.block_size, "rope_theta": c.rope_theta, "hidden_act": "silu",
            "attention_bias": False}


def save_drafter(model: Drafter, out_dir: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` in the published layout, atomically."""
    out = Path(out_dir)
    params = unsanitize(dict(tree_flatten(model.parameters())))
    with atomic_path(out / "model.safetensors") as tmp:
        mx.save_safetensors(str(tmp), params, metadata={"format": "mlx"})
    with atomic_path(out / "config.json") as tmp:
        tmp.write_text(json.dumps(published_config(model.config, extra_config), indent=2))
    return out
