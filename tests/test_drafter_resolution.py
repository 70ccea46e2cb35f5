"""What SGLang, vLLM and llama.cpp's GGUF converter resolve from the drafters we ship and write.

None of those runtimes can run here (they need CUDA and torch), so each rule they apply to a drafter is
re-derived below as a small pure function whose docstring names the file and commit it mirrors
(interop.md §1.1-1.5). The rules are applied to the shipped drafters, to the shipped drafters re-written by
`save_drafter`, and to tiny drafters written by `save_drafter` (`train fit`) and `export_drafter`.
SGLang and vLLM read config.json through transformers (AutoConfig -> Qwen3Config); llama.cpp's converter
reads it as plain JSON. Weights are checked from the safetensors headers only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from dflash2_mlx import paths
from dflash2_mlx.drafter.load import load_drafter, save_drafter
from dflash2_mlx.train.export import export_drafter
from dflash2_mlx.train.init import default_target_layer_ids

from tiny import HIDDEN, MASK_ID, VOCAB, tiny_drafter

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent.parent / "models"

# ---------------------------------------------------------------------------------------------------------
# The values each drafter is meant to give. The v2 values are the shipped drafter's intended ones
# (trained at block 4 since 2026-12-03); the v1 demo drafter shares its shape, at block 8.
# Tiny drafters: tests/tiny.py `drafter_config_dict`.
# ---------------------------------------------------------------------------------------------------------
SHIPPED_V2 = dict(arch="DFlash2DraftModel", layers=2, block=4, taps=[1, 8, 14, 20, 27], n_target=30, mask=16,
                  window=2048, conv=(2, 16), selector=(64, 16), hidden=576, vocab=49152)
SHIPPED_V1 = dict(SHIPPED_V2, arch="DFlashDraftModel", block=8, conv=None, selector=None)  # v1 trained at block 8
TINY_V2 = dict(arch="DFlash2DraftModel", layers=2, block=4, taps=[0, 2, 3], n_target=4, mask=MASK_ID, window=16,
               conv=(2, 16), selector=(16, 8), hidden=HIDDEN, vocab=VOCAB)
TINY_V1 = dict(TINY_V2, arch="DFlashDraftModel", conv=None, selector=None)

CASES = {
    "shipped-dflash2": SHIPPED_V2,
    "shipped-dflash": SHIPPED_V1,
    "resaved-dflash2": SHIPPED_V2,
    "resaved-dflash": SHIPPED_V1,
    "fit-dflash2": TINY_V2,
    "export-dflash2": TINY_V2,
    "fit-dflash": TINY_V1,
    "export-dflash": TINY_V1,
}
V1_CASES = [name for name, want in CASES.items() if want["arch"] == "DFlashDraftModel"]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    """Every drafter directory under test, by case name."""
    root = tmp_path_factory.mktemp("drafters")
    out = {"shipped-dflash2": MODELS / "smollm2-135m-dflash2", "shipped-dflash": MODELS / "smollm2-135m-dflash"}
    for arch in ("dflash2", "dflash"):
        out[f"resaved-{arch}"] = save_drafter(load_drafter(out[f"shipped-{arch}"]), root / f"resaved-{arch}")
        fit = save_drafter(tiny_drafter(None, arch, block_size=4), root / f"fit-{arch}")
        out[f"fit-{arch}"] = fit
        out[f"export-{arch}"] = export_drafter(fit, root / f"export-{arch}", "bfloat16")
    return out


def _auto(path: Path):
    """The config object SGLang and vLLM hold: transformers' AutoConfig of the drafter directory."""
    return transformers.AutoConfig.from_pretrained(str(path))


def _raw(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from the JSON headers of the drafter's *.safetensors (no tensor data read)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    return out


def _dflash(cfg) -> dict:
    return dict(getattr(cfg, "dflash_config", None) or {})


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


# ---------------------------------------------------------------------------------------------------------
# SGLang. sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py @00731f0, and
# python/sglang/srt/models/dflash.py in its post-#35371 version with DFlash 2 (file-index id 66194365551;
# the index did not name its repository or commit, and the indexed sglang copy at 7f151c5 predates DFlash 2).
# ---------------------------------------------------------------------------------------------------------
SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"


def sglang_build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Taps SGLang picks when the config names none: round(1 + i (L - 4) / (n - 1)), or [L // 2] for one.

    Mirrors `build_target_layer_ids` in python/sglang/srt/speculative/dflash_utils.py @00731f0.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError("needs num_target_layers >= 4")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def sglang_draft_config(cfg) -> dict:
    """The drafter fields SGLang resolves, with its fallbacks and checks.

    Mirrors `parse_dflash_draft_config` and `DFlashDraftConfig.resolve_target_layer_ids`
    (python/sglang/srt/speculative/dflash_utils.py @00731f0) and `DFlashDraftModel.__init__`
    (models/dflash.py, id 66194365551): `block_size`, `num_target_layers`, `target_layer_ids`, `mask_token`
    and `mask_token_id` are read from `dflash_config` first, then from the top level; the conv and selector
    fields only from `dflash_config`, and in pairs. A missing block size becomes 16
    (`resolve_block_size(default=16)`); the range check on the taps uses `num_target_layers`, else
    max(taps) + 1; `mask_token` defaults to "<|MASK|>". `DFlash2DraftModel` also requires a `selector_rank`.
    """
    d = _dflash(cfg)
    n_layers = getattr(_text_config(cfg), "num_hidden_layers", None)
    if n_layers is None or int(n_layers) < 1:
        raise ValueError("DFLASH requires draft num_hidden_layers in config")
    n_layers = int(n_layers)
    n_target = d.get("num_target_layers", getattr(cfg, "num_target_layers", None))
    block = d.get("block_size", getattr(cfg, "block_size", None))
    conv = (int(d.get("conv_kernel_size", 0)), int(d.get("conv_group_size", 0)))
    if bool(conv[0]) != bool(conv[1]):
        raise ValueError("DFLASH grouped convolution needs conv_kernel_size and conv_group_size together")
    selector = (int(d.get("selector_rank", 0)), int(d.get("selector_top_k", 0)))
    if bool(selector[0]) != bool(selector[1]):
        raise ValueError("DFLASH selector needs rank and top_k together")
    ids = d.get("target_layer_ids", getattr(cfg, "target_layer_ids", None))
    if n_target is not None:
        n_target = int(n_target)
    elif ids is not None:
        n_target = max(ids) + 1
    else:
        n_target = n_layers
    if ids is None:
        ids = sglang_build_target_layer_ids(n_target, n_layers)
    ids = [int(i) for i in ids]
    if not ids or any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"DFLASH target_layer_ids {ids} out of range for {n_target} target layers")
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    if arch == "DFlash2DraftModel" and not selector[0]:
        raise ValueError("DFlash selector draft requires dflash_config.selector_rank")
    mask_id = d.get("mask_token_id", getattr(cfg, "mask_token_id", None))
    return dict(
        num_hidden_layers=n_layers, num_target_layers=n_target, block_size=16 if block is None else int(block),
        conv=conv if conv[0] else None, selector=selector if selector[0] else None, target_layer_ids=ids,
        mask_token=d.get("mask_token", getattr(cfg, "mask_token", None)) or SGLANG_DEFAULT_MASK_TOKEN,
        mask_token_id=None if mask_id is None else int(mask_id),
    )


def sglang_window_left(cfg) -> int | None:
    """SGLang's stored window for sliding layers: `sliding_window - 1` (it stores window_left; HF windows
    include the current token); an error when a sliding layer has no `sliding_window`.

    Mirrors `get_dflash_attention_sliding_window_size` (dflash_utils.py @00731f0). Its Nemotron 3.5 fallback
    to `dflash_config.swa_window_size` applies only to that family and is left out.
    """
    types = getattr(_text_config(cfg), "layer_types", None)
    if types is None or "sliding_attention" not in types:
        return None
    window = getattr(_text_config(cfg), "sliding_window", None)
    if window is None:
        raise ValueError("DFLASH sliding_attention layers require config.sliding_window.")
    return int(window) - 1


def sglang_layer_attention(cfg, layer_id: int) -> tuple[int, str]:
    """(window_left or -1, attention type) of one draft layer.

    Mirrors `_get_dflash_layer_attention_params` and `_get_dflash_attention_type` (models/dflash.py,
    id 66194365551): full layers default to ENCODER_ONLY (non-causal), sliding layers to DECODER (causal),
    unless the top-level `is_causal` is set, which then decides for every layer. As the source reads, a
    config with no `layer_types` at all gets ENCODER_ONLY regardless of `is_causal`; older SGLang builds did
    not honour `is_causal` at all (interop.md §1.1), which these tests cannot see.
    """
    types = getattr(_text_config(cfg), "layer_types", None)
    if types is None:
        return -1, "ENCODER_ONLY"
    if layer_id >= len(types):
        raise ValueError("DFLASH config.layer_types must contain one entry per draft layer")
    is_causal = getattr(_text_config(cfg), "is_causal", None)

    def kind(default: str) -> str:
        return default if is_causal is None else ("DECODER" if is_causal else "ENCODER_ONLY")

    if types[layer_id] == "full_attention":
        return -1, kind("ENCODER_ONLY")
    if types[layer_id] == "sliding_attention":
        return sglang_window_left(cfg), kind("DECODER")
    raise ValueError(f"Unsupported DFLASH draft layer type {types[layer_id]!r}")


_STACKED = (("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
            ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj"))


def sglang_module_params(cfg) -> set[str]:
    """Parameter names of the drafter module SGLang builds (no `embed_tokens`: only Nemotron 3.5 drafts have
    one; no `lm_head`: DFlash2DraftModel's is None until the worker points it at the target's).

    Mirrors `DFlashAttention`, `DFlashMLP`, `DFlashGroupedConv`, `DFlashDecoderLayer`, `DFlashDraftModel`,
    `CandidateSelector` and `DFlash2DraftModel` in models/dflash.py (id 66194365551).
    """
    sg = sglang_draft_config(cfg)
    names = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(sg["num_hidden_layers"]):
        names |= {f"layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_up_proj.weight", "mlp.down_proj.weight")}
        if sg["conv"]:
            names |= {f"layers.{i}.{c}.{n}" for c in ("attention_conv", "mlp_conv")
                      for n in ("base_kernel", "kernel_projection.weight")}
    if getattr(cfg, "architectures", [None])[0] == "DFlash2DraftModel":
        names |= {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                  "candidate_selector.hidden_projection.weight"}
    return names


def sglang_load(names, params: set[str]) -> tuple[set[str], list[str]]:
    """(parameters loaded, checkpoint tensors ignored) when SGLang loads tensors `names`.

    Mirrors `DFlashDraftModel.load_weights` (models/dflash.py, id 66194365551): q/k/v and gate/up names are
    redirected to the stacked parameter when it exists; an optional `model.` prefix is stripped (or added);
    Muse's `encoder.fc` / `encoder.output_norm_enc` are aliased; any other unknown tensor is **ignored** and
    only counted in a log line, so a wrong name loses weights silently.
    """
    aliases = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}

    def resolve(name: str) -> str | None:
        if name in params:
            return name
        other = name[len("model."):] if name.startswith("model.") else f"model.{name}"
        if other in params:
            return other
        return aliases.get(name) if aliases.get(name) in params else None

    loaded, ignored = set(), []
    for name in names:
        for param, weight in _STACKED:
            if f".{weight}." in name and (hit := resolve(name.replace(weight, param))) is not None:
                loaded.add(hit)
                break
        else:
            hit = resolve(name)
            if hit is None:
                ignored.append(name)
            else:
                loaded.add(hit)
    return loaded, sorted(ignored)


# ---------------------------------------------------------------------------------------------------------
# vLLM. vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py @036a00d, qwen3_dflash2.py @030da62,
# vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @0cfdd2e, spec_decode/dflash2/speculator.py @030da62.
# ---------------------------------------------------------------------------------------------------------
def vllm_aux_layer_ids(cfg) -> tuple[int, ...] | None:
    """Target layers whose outputs vLLM feeds the drafter, in vLLM's numbering.

    Mirrors `get_eagle3_aux_layers_from_config` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
    @0cfdd2e): top-level `eagle_aux_hidden_state_layer_ids` wins as is; else `dflash_config.target_layer_ids`
    **+ 1** ("convert DFlash's aux layer id semantics": vLLM captures the input of layer i + 1, DFlash names
    the output of layer i); else `dspark_target_layer_ids` (+1, except deepseek_v41); else top-level
    `target_layer_ids` + 1; else `dflash_config.layer_ids` / `eagle_config.layer_ids` as is.
    """
    ids = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        d = getattr(cfg, "dflash_config", None)
        if d and isinstance(d, dict):
            ids = [i + 1 for i in (d.get("target_layer_ids") or [])]
    if not ids:
        dspark = getattr(cfg, "dspark_target_layer_ids", None)
        if dspark:
            ids = list(dspark) if getattr(cfg, "model_type", None) == "deepseek_v41" else [i + 1 for i in dspark]
    if not ids:
        top = getattr(cfg, "target_layer_ids", None)
        if top:
            ids = [i + 1 for i in top]
    if not ids:
        for name in ("dflash_config", "eagle_config"):
            sub = getattr(cfg, name, None)
            if sub and isinstance(sub, dict) and sub.get("layer_ids"):
                ids = sub["layer_ids"]
                break
    return tuple(ids) if ids and isinstance(ids, (list, tuple)) else None


def vllm_mask_token_id(cfg) -> int:
    """The id vLLM fills the masked block slots with.

    Mirrors `get_parallel_drafting_token_id` (vllm/v1/worker/gpu/spec_decode/utils.py, file-index id
    54499170193, imported by spec_decode/dflash/speculator.py @0074614): `dflash_config.mask_token_id`, then
    top-level `mask_token_id`, then the DSpark / PARD alternatives; ValueError if none. `DFlashQwen3Model`
    (qwen3_dflash.py @036a00d) reads the same key, nested first.
    """
    d = _dflash(cfg)
    if "mask_token_id" in d:
        return int(d["mask_token_id"])
    if getattr(cfg, "mask_token_id", None) is not None:
        return int(cfg.mask_token_id)
    for name in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if hasattr(cfg, name):
            return int(getattr(cfg, name))
    raise ValueError("Model config must specify `dflash_config.mask_token_id` (or an alternative)")


def vllm_layer_causal(cfg, layer_idx: int) -> bool:
    """Mirrors `_dflash_layer_causal` (qwen3_dflash.py @036a00d): top-level `is_causal` first, then
    `dflash_config.causal`, then "causal iff the layer is sliding"."""
    is_causal = getattr(cfg, "is_causal", None)
    if is_causal is not None:
        return bool(is_causal)
    override = _dflash(cfg).get("causal")
    if override is not None:
        return bool(override)
    types = getattr(cfg, "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"


def vllm_layer_attention(cfg, layer_idx: int, v2_runner: bool = False) -> tuple[int | None, bool]:
    """(sliding window or None, causal) of one draft layer.

    Mirrors `_resolve_layer_attention` (qwen3_dflash.py @036a00d): mixed sliding/full `layer_types` need the
    V2 model runner; `dflash_config.use_swa` forces sliding when no layer is sliding; a sliding layer takes
    `dflash_config.swa_window_size`, else the top-level `sliding_window`, and raises when both are None
    (which is what transformers leaves when `use_sliding_window` is absent).
    """
    d = _dflash(cfg)
    types = getattr(cfg, "layer_types", None)
    use_swa = d.get("use_swa", False)
    any_sliding = False
    if types is not None:
        n_sliding = sum(t == "sliding_attention" for t in types)
        any_sliding = n_sliding > 0
        if 0 < n_sliding < len(types) and not v2_runner:
            raise NotImplementedError("mixed sliding/full attention requires VLLM_USE_V2_MODEL_RUNNER=1")
    is_sliding = use_swa if types is None or (use_swa and not any_sliding) else types[layer_idx] == "sliding_attention"
    window = None
    if is_sliding:
        window = d.get("swa_window_size", getattr(cfg, "sliding_window", None))
        if window is None:
            raise ValueError("DFlash sliding attention requires a window size")
    return window, vllm_layer_causal(cfg, layer_idx)


def vllm_dflash2_fields(cfg) -> dict:
    """DFlash 2 fields vLLM reads, all required (`dflash_config[...]`, so KeyError when missing).

    Mirrors `DFlash2Qwen3DecoderLayer`, `DFlash2Qwen3Model`, `DFlash2Qwen3ForCausalLM` (qwen3_dflash2.py
    @030da62) and `DFlash2Speculator` (spec_decode/dflash2/speculator.py @030da62). Note the convolution's
    block size is not read from the config: it is `1 + num_speculative_tokens`, the runtime block.
    """
    d = cfg.dflash_config
    return dict(conv_kernel_size=int(d["conv_kernel_size"]), conv_group_size=int(d["conv_group_size"]),
                selector_rank=int(d["selector_rank"]), selector_top_k=int(d["selector_top_k"]),
                input_embedding_scale=float(d.get("input_embedding_scale", 1.0)),
                output_multiplier=float(d.get("output_multiplier", 1.0)))


def vllm_conv_block_size(num_speculative_tokens: int) -> int:
    """Mirrors `DFlash2Qwen3DecoderLayer`'s conv `block_size=1 + speculative_config.num_speculative_tokens`
    (qwen3_dflash2.py @030da62)."""
    return 1 + num_speculative_tokens


def vllm_fc_input_size(cfg) -> int:
    """Mirrors `_get_dflash_fc_input_size` (qwen3_dflash.py @036a00d): (target_hidden_size or hidden_size)
    x number of aux layers (else num_hidden_layers)."""
    aux = vllm_aux_layer_ids(cfg)
    n = len(aux) if aux else cfg.num_hidden_layers
    return (getattr(cfg, "target_hidden_size", None) or cfg.hidden_size) * n


def vllm_module_params(cfg) -> set[str]:
    """Parameter names of `DFlash2Qwen3ForCausalLM` / `DFlashQwen3ForCausalLM` that a checkpoint fills, when
    it ships no `embed_tokens`, `lm_head`, `d2t` or `mask_embedding.pt` (those modules are then deferred or
    dropped by the load mapper, and the target's embedding and head are used).

    Mirrors `DFlashQwen3Attention`, `DFlashQwen3DecoderLayer`, `DFlashQwen3Model` (qwen3_dflash.py @036a00d)
    and `DFlashGroupedConv`, `CandidateSelector`, `DFlash2Qwen3Model` (qwen3_dflash2.py @030da62).
    """
    v2 = getattr(cfg, "architectures", [None])[0] == "DFlash2DraftModel"
    names = {"model.norm.weight", "model.hidden_norm.weight"}
    if _dflash(cfg).get("use_aux_hidden_state", getattr(cfg, "use_aux_hidden_state", True)):
        names.add("model.fc.weight")
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_up_proj.weight", "mlp.down_proj.weight")}
        if v2:
            names |= {f"model.layers.{i}.{c}.{n}" for c in ("attention_conv", "mlp_conv")
                      for n in ("base_kernel", "kernel_projection.weight")}
    if v2:
        names |= {"model.candidate_selector.predecessor_codebook", "model.candidate_selector.successor_codebook",
                  "model.candidate_selector.hidden_projection.weight"}
    return names


def vllm_load(names) -> dict:
    """Where vLLM routes checkpoint tensors `names`, and which own-copy switches they flip.

    Mirrors `DFlashQwen3ForCausalLM.load_weights` (qwen3_dflash.py @036a00d): a `mask_hidden` tensor is an
    assertion error; `t2d` is dropped; `d2t` becomes `draft_id_to_target_id`; every other name without
    `lm_head` gets `model.`; an `embed_tokens` / `lm_head` tensor makes the drafter use **its own** copy
    (`has_own_embed_tokens` / `has_own_lm_head`) instead of the target's. Then `DFlashQwen3Model`'s
    `hf_to_vllm_mapper` stacks q/k/v into qkv_proj and gate/up into gate_up_proj. `AutoWeightsLoader`
    rejects names it cannot place.
    """
    params, own_embed, own_head = set(), False, False
    for name in names:
        assert "mask_hidden" not in name
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        own_embed |= "embed_tokens" in name
        own_head |= "lm_head" in name
        for new, old in _STACKED:
            name = name.replace(f".{old}", f".{new}")
        params.add(name)
    return dict(params=params, has_own_embed_tokens=own_embed, has_own_lm_head=own_head)


# ---------------------------------------------------------------------------------------------------------
# llama.cpp. ggml-org/llama.cpp conversion/qwen.py @03173d5, class DFlashModel (convert_hf_to_gguf.py).
# ---------------------------------------------------------------------------------------------------------
LLAMACPP_REGISTERED = {"DFlashDraftModel": "DFlashModel"}  # @ModelBase.register("DFlashDraftModel") only


def llamacpp_converter_class(raw: dict) -> str | None:
    """The converter class picked for the drafter's architecture (None: "not supported").

    Mirrors the `@ModelBase.register("DFlashDraftModel")` on `DFlashModel` in conversion/qwen.py @03173d5,
    the only DFlash registration there: `DFlash2DraftModel` has no converter at that commit.
    """
    return LLAMACPP_REGISTERED.get((raw.get("architectures") or [None])[0])


def llamacpp_gguf_fields(raw: dict, target: dict | None = None) -> dict:
    """The DFlash GGUF keys the converter writes from config.json (read as plain JSON, no transformers).

    Mirrors `DFlashModel.set_gguf_parameters` (conversion/qwen.py @03173d5): `block_size` is read from the
    **top level only**, default 16 (a nested-only block size silently becomes 16); `target_layers` from
    `dflash_config.target_layer_ids`, else a SpecForge spread over the target's depth; `mask_token_id` from
    `dflash_config` only (not written when absent); `target_hidden_size` top-level, else the target's.
    """
    d = raw.get("dflash_config", {}) or {}
    ids = d.get("target_layer_ids")
    if ids is None:
        n_target, n_draft = target["num_hidden_layers"], raw["num_hidden_layers"]
        ids = [max(0, (i + 1) * n_target // (n_draft + 1) - 1) for i in range(n_draft)]
    mask = d.get("mask_token_id")
    hidden = raw.get("target_hidden_size") or (target or {}).get("hidden_size")
    return dict(block_size=int(raw.get("block_size", 16)), target_layers=[int(i) for i in ids],
                mask_token_id=None if mask is None else int(mask), target_hidden_size=hidden)


def llamacpp_tensor_route(name: str) -> str:
    """Where the converter sends a drafter tensor.

    Mirrors `DFlashModel.index_tensors` / `modify_tensors` (conversion/qwen.py @03173d5): `layers.*` and
    `norm.weight` get a `model.` prefix and go through the Qwen3 name map; `fc.weight` -> FC;
    `hidden_norm.weight` -> DFLASH_HIDDEN_NORM; `d2t` / `t2d` are dropped; anything else reaches the Qwen3
    map under its own name ("other": e.g. an `embed_tokens` would be written as the GGUF's token_embd).
    """
    if name.startswith("layers.") or name == "norm.weight":
        return "qwen3"
    return {"fc.weight": "fc", "hidden_norm.weight": "hidden_norm", "d2t": "dropped", "t2d": "dropped"}.get(
        name, "other")


# ---------------------------------------------------------------------------------------------------------
# Checkpoint tensor shapes both servers' trees expect (HF layout, before their own stacking).
# ---------------------------------------------------------------------------------------------------------
def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Shape of each checkpoint tensor as SGLang and vLLM size the module it loads into.

    Mirrors the constructors cited above: QKV/o projections from heads x head_dim (Qwen3 q_norm/k_norm over
    head_dim), MLP from intermediate_size; fc in-features = taps x hidden_size in SGLang
    (`DFlashDraftModel.__init__`) and taps x (target_hidden_size or hidden_size) in vLLM — equal here, and
    asserted so; `base_kernel` (2, conv taps, H); `kernel_projection` (2 x conv taps x H / group, H);
    codebooks (vocab, rank) **without** `.weight`; `hidden_projection` (rank, H).
    """
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    sg = sglang_draft_config(cfg)
    fc_in = len(sg["target_layer_ids"]) * h
    assert fc_in == vllm_fc_input_size(cfg)
    out = {"fc.weight": (h, fc_in), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter)})
        if sg["conv"]:
            taps, group = sg["conv"]
            for c in ("attention_conv", "mlp_conv"):
                out[p + c + ".base_kernel"] = (2, taps, h)
                out[p + c + ".kernel_projection.weight"] = (2 * taps * (h // group), h)
    if sg["selector"]:
        rank = sg["selector"][0]
        out.update({"candidate_selector.predecessor_codebook": (cfg.vocab_size, rank),
                    "candidate_selector.successor_codebook": (cfg.vocab_size, rank),
                    "candidate_selector.hidden_projection.weight": (rank, h)})
    return out


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_resolves_the_intended_values(drafters, case):
    want, cfg = CASES[case], _auto(drafters[case])
    sg = sglang_draft_config(cfg)
    assert sg["num_hidden_layers"] == want["layers"]
    assert sg["block_size"] == want["block"]  # nested dflash_config.block_size first, then top level, else 16
    assert sg["target_layer_ids"] == want["taps"] and sg["num_target_layers"] == want["n_target"]
    assert sg["mask_token_id"] == want["mask"] and sg["mask_token"] == SGLANG_DEFAULT_MASK_TOKEN
    assert sg["conv"] == want["conv"] and sg["selector"] == want["selector"]
    assert cfg.architectures == [want["arch"]]  # SGLang's EntryClass has DFlashDraftModel and DFlash2DraftModel
    for layer in range(want["layers"]):
        # window_left = sliding_window - 1; non-causal because top-level is_causal is false (a sliding layer
        # would otherwise default to DECODER, i.e. causal)
        assert sglang_layer_attention(cfg, layer) == (want["window"] - 1, "ENCODER_ONLY")


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_resolves_the_intended_values(drafters, case):
    want, cfg = CASES[case], _auto(drafters[case])
    assert vllm_aux_layer_ids(cfg) == tuple(i + 1 for i in want["taps"])  # DFlash ids + 1
    assert vllm_mask_token_id(cfg) == want["mask"]
    assert cfg.num_hidden_layers == want["layers"]
    for layer in range(want["layers"]):
        assert vllm_layer_attention(cfg, layer, v2_runner=False) == (want["window"], False)
    if want["conv"]:
        fields = vllm_dflash2_fields(cfg)
        assert (fields["conv_kernel_size"], fields["conv_group_size"]) == want["conv"]
        assert (fields["selector_rank"], fields["selector_top_k"]) == want["selector"]
        assert fields["input_embedding_scale"] == 1.0 and fields["output_multiplier"] == 1.0
    else:
        with pytest.raises(KeyError):
            vllm_dflash2_fields(cfg)
    # vLLM takes the block from the launch, not the config: the trained block needs
    # num_speculative_tokens = block_size - 1 (7 for the shipped drafters).
    assert vllm_conv_block_size(_dflash(cfg)["block_size"] - 1) == want["block"]


@pytest.mark.parametrize("case", list(CASES))
def test_llamacpp_converter_resolves_the_intended_values(drafters, case):
    want, raw = CASES[case], _raw(drafters[case])
    assert "block_size" in raw, "the converter reads only the top-level block_size and would write 16"
    fields = llamacpp_gguf_fields(raw, target={"hidden_size": want["hidden"], "num_hidden_layers": want["n_target"]})
    assert fields["block_size"] == want["block"] == raw["dflash_config"]["block_size"]
    assert fields["target_layers"] == want["taps"]
    assert fields["mask_token_id"] == want["mask"]
    assert fields["target_hidden_size"] == want["hidden"]
    # @03173d5 converts only DFlashDraftModel; a DFlash 2 drafter has no GGUF converter there.
    expected_class = "DFlashModel" if want["arch"] == "DFlashDraftModel" else None
    assert llamacpp_converter_class(raw) == expected_class


@pytest.mark.parametrize("case", list(CASES))
def test_weights_have_no_embedding_or_head_and_fill_the_sglang_tree(drafters, case):
    cfg, names = _auto(drafters[case]), set(_header(drafters[case]))
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n]
    loaded, ignored = sglang_load(names, sglang_module_params(cfg))
    assert ignored == []  # SGLang would drop these silently
    assert loaded == sglang_module_params(cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_weights_fill_the_vllm_tree_and_share_the_targets_embedding_and_head(drafters, case):
    cfg, names = _auto(drafters[case]), set(_header(drafters[case]))
    routed = vllm_load(names)
    assert routed["has_own_embed_tokens"] is False and routed["has_own_lm_head"] is False
    assert routed["params"] == vllm_module_params(cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_weight_shapes_match_the_trees_the_servers_build(drafters, case):
    want, cfg, header = CASES[case], _auto(drafters[case]), _header(drafters[case])
    assert {k: shape for k, (_, shape) in header.items()} == expected_shapes(cfg)
    assert header["fc.weight"][1] == (want["hidden"], want["hidden"] * len(want["taps"]))
    if want["selector"]:
        assert header["candidate_selector.predecessor_codebook"][1] == (want["vocab"], want["selector"][0])
    floating = {dtype for dtype, _ in header.values()}
    assert floating == ({"BF16"} if case.split("-")[0] in ("shipped", "resaved", "export") else {"F32"})


@pytest.mark.parametrize("case", V1_CASES)
def test_llamacpp_converter_routes_every_v1_tensor(drafters, case):
    routes = {name: llamacpp_tensor_route(name) for name in _header(drafters[case])}
    assert [n for n, r in routes.items() if r == "other"] == []
    assert sum(r == "fc" for r in routes.values()) == 1 and sum(r == "hidden_norm" for r in routes.values()) == 1


def test_sglang_default_taps_are_ours_and_the_shipped_ones():
    assert sglang_build_target_layer_ids(30, 5) == default_target_layer_ids(30, 5) == SHIPPED_V2["taps"]
    for n_layers, n_taps in ((4, 2), (28, 5), (36, 3), (64, 5), (30, 1)):
        assert sglang_build_target_layer_ids(n_layers, n_taps) == default_target_layer_ids(n_layers, n_taps)


def test_shipped_mask_id_passes_sglangs_tokenizer_checks_on_the_demo_target():
    """SGLang: the id must be < vocab, and the tokenizer must not also hold `mask_token` ("<|MASK|>") at
    another id (interop.md §1.1). Needs the demo target converted into the dflash2 cache."""
    target = paths.models_cache() / "smollm2-135m-instruct"
    if not (target / "tokenizer.json").is_file():
        pytest.skip(f"no demo target at {target} (run a dflash2 command on the demo target once)")
    vocab = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
    tconf = json.loads((target / "config.json").read_text())
    for path in (MODELS / "smollm2-135m-dflash2", MODELS / "smollm2-135m-dflash"):
        sg = sglang_draft_config(_auto(path))
        assert sg["mask_token"] not in vocab
        assert sg["mask_token_id"] < tconf["vocab_size"] == SHIPPED_V2["vocab"]
        assert sg["num_target_layers"] == tconf["num_hidden_layers"]
        assert max(sg["target_layer_ids"]) < tconf["num_hidden_layers"]
        assert llamacpp_gguf_fields(_raw(path), tconf)["target_hidden_size"] == tconf["hidden_size"]
