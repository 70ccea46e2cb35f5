"""What `dflash2 doctor` reports: the MLX runtime, kernels, BLAS, caches, and memory estimates.

`environment()` describes this machine; `estimate_memory(model, drafter, context)` predicts
the footprint of a pair before loading it, from `config.json` and the safetensors sizes
(local, cached, or listed by the Hub when it is reachable; GGUFs from their tensor counts):
weights + KV cache, which grows per token in full-attention layers and stops at the window
in sliding ones (linear-attention layers keep a fixed state, counted as zero).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from . import hub, paths
from .registry import load_registry

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GB = 1e9


# -- environment ----------------------------------------------------------------------------


def _system_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device() -> dict:
    """MLX version, backend and memory of the default device."""
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        info = dict(info_fn())
    except RuntimeError:
        info = {}
    memory = info.get("memory_size") or _system_memory()
    return {
        "mlx": mx.__version__,
        "backend": "metal" if metal else "cuda" if cuda else "cpu",
        "default_device": str(mx.default_device()),
        "device_name": info.get("device_name") or info.get("architecture"),
        "memory_bytes": memory,
        "recommended_working_set_bytes": info.get("max_recommended_working_set_size"),
    }


def usable_memory() -> int | None:
    """Bytes the device may use: Metal's recommended working set, else its (or the system's) memory."""
    dev = device()
    return dev["recommended_working_set_bytes"] or dev["memory_bytes"]


def kernels() -> dict:
    from .kernels import selector

    status = getattr(selector, "status", None)
    return status() if status else {"selector": "kernel" if selector.available() else "ops"}


def calibrations() -> list[dict]:
    try:
        from .core.block_policy import calibration_info
    except ImportError:
        return []
    return calibration_info()


def caches() -> dict:
    """The dflash2 cache (per entry) and the HF snapshots of registry models, with sizes."""
    models = paths.models_cache()
    entries = [{"path": str(p), "bytes": paths.dir_size(p)} for p in sorted(models.iterdir())
               if p.is_dir() and not p.name.startswith(".")] if models.is_dir() else []
    registry = load_registry()
    repos = {e["target"] for e in registry.models.values()} | {
        e["drafter"] for e in registry.models.values() if e.get("drafter") and ":" not in e["drafter"]}
    cached = []
    for repo in sorted(repos):
        path = hub.cached_repo(repo, hub.MODEL_PATTERNS + hub.DRAFTER_PATTERNS)
        if path is not None:
            cached.append({"repo": repo, "path": str(path), "bytes": paths.dir_size(path)})
    return {"home": str(paths.home()), "home_bytes": paths.dir_size(paths.home()), "entries": entries,
            "hf_cache": str(paths.hf_cache()), "hf_registry_repos": cached}


def environment() -> dict:
    from . import __version__, blas

    return {"dflash2": __version__, "python": sys.version.split()[0],
            "platform": f"{platform.system()} {platform.machine()}", "device": device(),
            "kernels": kernels(), "blas": blas.describe(), "cache": caches(),
            "calibrations": calibrations(), "hf_offline": hub.offline(), "distributed": distributed()}


def distributed() -> dict | None:
    """This process's group when launched by `mlx.launch` (size > 1), else None: under a launch
    a sharded run holds 1/size of each decoder layer per rank and the drafter on rank 0."""
    from .core.distributed import launched

    lockstep = launched()
    if lockstep is None:
        return None
    info = lockstep.describe()
    info["holds"] = ("the drafter, the output head and embeddings, and 1/{0} of every decoder layer"
                     if lockstep.leader else "the output head and embeddings and 1/{0} of every decoder layer")
    info["holds"] = info["holds"].format(lockstep.size)
    return info


# -- memory estimate ----------------------------------------------------------------------


def layer_windows(cfg: dict) -> list[int | None]:
    """Per layer: None (KV grows with the context), a window, or 0 (no KV: linear attention)."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    kinds = cfg.get("layer_types")
    if kinds:
        return [None if k == "full_attention" else (window or None) if k == "sliding_attention" else 0
                for k in kinds]
    if cfg.get("sliding_window_pattern") and window:  # gemma: every n-th layer is global
        p = int(cfg["sliding_window_pattern"])
        return [None if (i + 1) % p == 0 else window for i in range(n)]
    if cfg.get("full_attention_interval"):  # hybrid linear attention (qwen3-next / qwen3.5)
        p = int(cfg["full_attention_interval"])
        return [None if (i + 1) % p == 0 else 0 for i in range(n)]
    return [None] * n


def kv_bytes(cfg: dict, context: int, dtype_bytes: int) -> int:
    """Keys + values of `context` tokens across layers."""
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    per_token = 2 * heads * head_dim * dtype_bytes
    return sum(per_token * (context if w is None else min(context, w)) for w in layer_windows(cfg))


def _activation_bytes(cfg: dict, dtype: str | None) -> int:
    if dtype:
        return _DTYPE_BYTES[dtype]
    if "quantization" in cfg:
        return 2  # quantized models compute in their scales' half type
    return cfg.get("_stored_bytes") or _DTYPE_BYTES.get(cfg.get("torch_dtype") or cfg.get("dtype") or "", 2)


_HEADER_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _stored_float_bytes(directory: Path) -> int | None:
    """The item size of the floating tensors in a directory's safetensors (from headers)."""
    counts: dict[int, int] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, meta in header.items():
            if key != "__metadata__" and meta["dtype"] in _HEADER_BYTES:
                counts[_HEADER_BYTES[meta["dtype"]]] = counts.get(_HEADER_BYTES[meta["dtype"]], 0) + 1
    return max(counts, key=counts.get) if counts else None


def _files_and_config(loc: hub.Location) -> tuple[dict, int, str] | None:
    """(config, weight bytes, where) for a location, or None when unknown offline.

    The config gets `_stored_bytes`, the item size its float weights have on disk.
    """
    if loc.path is not None:
        size = sum(f.stat().st_size for f in Path(loc.path).glob("*.safetensors"))
        cfg = hub.text_config(loc.path)
        return {**cfg, "_stored_bytes": _stored_float_bytes(loc.path)}, size, "local"
    if loc.gguf is not None:
        from .convert import _open, gguf_config

        reader = _open(loc.gguf)
        cfg = gguf_config(reader, str(reader.fields["general.architecture"].contents()))
        params = sum(int(t.n_elements) for t in reader.tensors)
        return {**cfg, "_stored_bytes": 2}, params * 2, "gguf (bfloat16 after conversion)"
    if loc.remote is not None and hub.hub_reachable():
        from huggingface_hub import HfApi, hf_hub_download

        info = HfApi().model_info(loc.remote, files_metadata=True)
        size = sum(s.size or 0 for s in info.siblings if s.rfilename.endswith(".safetensors"))
        cfg_path = hf_hub_download(loc.remote, "config.json", cache_dir=paths.hf_cache())
        cfg = json.loads(Path(cfg_path).read_text())
        cfg = {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg
        return cfg, size, "hub"
    return None


def _scaled_weights(size: int, cfg: dict, dtype: str | None, bits: int | None) -> int:
    stored = cfg.get("_stored_bytes") or _DTYPE_BYTES.get(cfg.get("torch_dtype") or cfg.get("dtype") or "", 2)
    if "quantization" in cfg:
        return size
    if bits:  # affine quantization: `bits` per weight + a 16-bit scale and bias per 64 weights
        return int(size * (bits + 0.5) / (8 * stored))
    return int(size * _DTYPE_BYTES[dtype] / stored) if dtype else size


def proposal_vocab(drafter_dir: Path | None, vocab_size: int, size: int | None, act_bytes: int) -> dict:
    """Whether the drafter drafts through a compact head, its size, provenance and extra bytes."""
    from .drafter.vocab import FILE_NAME, resolve_vocab
    from .errors import ConfigError

    try:
        vocab = resolve_vocab(drafter_dir, vocab_size, size)
    except ConfigError as e:
        return {"active": False, "reason": str(e)}
    if vocab is None:
        why = "turned off by --draft-vocab 0" if size == 0 else f"no {FILE_NAME} next to the drafter"
        return {"active": False, "reason": why}
    return {"active": True, **vocab.describe(), "head_bytes": vocab.size * _hidden_of(drafter_dir) * act_bytes}


def _hidden_of(drafter_dir: Path) -> int:
    return int(json.loads((Path(drafter_dir) / "config.json").read_text())["hidden_size"])


def estimate_memory(model: str | None, drafter: str | None = None, context: int = 4096,
                    draft_bits: int | None = None, dtype: str | None = None,
                    draft_vocab: int | None = None) -> dict:
    """Predicted memory of MODEL (+ drafter) at `context` tokens, before loading anything.

    Returns:
        a dict of byte counts; with "unavailable" (and no numbers) when the target is neither
        local nor listed by a reachable Hub.
    Raises:
        ResolveError: unknown alias or missing path (as `hub.resolve` would).
    """
    name, target_loc, drafter_loc = hub.locate(model, drafter)
    registry = load_registry()
    alias = registry.find(name) if name else None
    defaults = registry.models[alias].get("defaults", {}) if alias else {}
    dtype = dtype or defaults.get("dtype")
    draft_bits = draft_bits if draft_bits is not None else defaults.get("draft_bits")
    draft_vocab = draft_vocab if draft_vocab is not None else defaults.get("draft_vocab")
    out: dict = {"model": name, "context": context, "target": None, "drafter": None, "notes": []}
    found = _files_and_config(target_loc)
    if found is None:
        out["unavailable"] = (f"{target_loc.ref} is not cached and Hugging Face is unreachable; "
                              f"run `dflash2 download {model or name}` where it is reachable")
        return out
    cfg, size, where = found
    act = _activation_bytes(cfg, dtype)
    out["target"] = {"ref": target_loc.ref, "source": where, "weights_bytes": _scaled_weights(size, cfg, dtype, None),
                     "kv_bytes_per_1k": kv_bytes(cfg, 1000, act), "kv_bytes": kv_bytes(cfg, context, act)}
    if drafter_loc is not None:
        dfound = _files_and_config(drafter_loc)
        if dfound is None:
            out["notes"].append(f"drafter {drafter_loc.ref} is not cached; its size is unknown offline")
        else:
            dcfg, dsize, dwhere = dfound
            window = dcfg.get("sliding_window")
            dcfg = {**dcfg, "sliding_window": window - 1 if window else None}  # context rows kept
            out["drafter"] = {"ref": drafter_loc.ref, "source": dwhere, "untrained": drafter_loc.untrained,
                              "weights_bytes": _scaled_weights(dsize, dcfg, dtype, draft_bits),
                              "kv_bytes": kv_bytes(dcfg, context, act)}
            if drafter_loc.path is not None:  # the compact head is a private copy of target rows
                pv = proposal_vocab(drafter_loc.path, int(dcfg["vocab_size"]), draft_vocab, act)
                out["drafter"]["proposal_vocab"] = pv
                out["drafter"]["weights_bytes"] += pv.get("head_bytes", 0)
    parts = [out["target"]["weights_bytes"], out["target"]["kv_bytes"]]
    if out["drafter"]:
        parts += [out["drafter"]["weights_bytes"], out["drafter"]["kv_bytes"]]
    out["total_bytes"] = int(sum(parts) * 1.1)  # ~10% for activations, logits and allocator slack
    budget = usable_memory()
    out["device_bytes"] = budget
    out["fits"] = None if not budget else out["total_bytes"] <= budget
    return out
