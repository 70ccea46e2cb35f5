"""Drafter config: both published schemas → one frozen dataclass, and the fit check.

Schemas (dflash-algorithm.md §1.8, §2.1):
* legacy: `block_size`, `rope_theta` (and for Meta's assistant: `mask_token_id`,
  `target_layer_ids`) at the top level;
* current: `dflash_config{...}` and `rope_parameters{rope_theta, rope_type}`.
Architectures: `DFlashDraftModel` (v1), `DFlash2DraftModel` (v2),
`MuseGlimmerAssistantModel` (Meta's v1 variant, in-block attention never causal).
Unknown `dflash_config` keys are rejected: several runtimes silently ignored them. Keys that only
training uses (`num_anchors`, `loss_decay_gamma`, `backbone_rotary_base`) are accepted and mean
nothing here; keys that would change inference and are not implemented are refused by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError, IncompatibleDrafterError

ARCHITECTURES = {
    "DFlashDraftModel": "dflash",
    "DFlash2DraftModel": "dflash2",
    "MuseGlimmerAssistantModel": "muse",
}

_DFLASH_KEYS = {
    "mask_token_id", "target_layer_ids", "block_size", "causal", "conv_kernel_size",
    "conv_group_size", "selector_rank", "selector_top_k", "final_logit_softcapping",
    "output_multiplier", "input_embedding_scale", "use_swa",
}
_TRAINING_ONLY_KEYS = {"num_anchors", "loss_decay_gamma", "backbone_rotary_base"}
_UNSUPPORTED_KEYS = {"swa_window_size", "attention_sink_bias", "attention_value_scale"}
_REQUIRED = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "vocab_size",
)
_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class DrafterConfig:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    final_logit_softcapping: float | None = None
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    @property
    def is_v2(self) -> bool:
        return self.arch == "dflash2"

    @property
    def context_limit(self) -> int | None:
        """How many context rows the drafter can ever attend to (None = unbounded)."""
        if all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window - 1
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _require(cfg: dict, key: str):
    if key not in cfg:
        raise ConfigError(f"drafter config.json is missing {key!r}")
    return cfg[key]


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ConfigError("drafter config.json has no 'architectures'")
    if archs[0] not in ARCHITECTURES:
        raise ConfigError(
            f"unknown drafter architecture {archs[0]!r}; expected one of {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[archs[0]]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    if params:
        params = dict(params)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            params = None
    return float(theta), params


def _layer_types(cfg: dict, n_layers: int) -> tuple[str, ...]:
    types = tuple(cfg.get("layer_types") or ("full_attention",) * n_layers)
    if len(types) != n_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers={n_layers}")
    unknown = set(types) - _LAYER_TYPES
    if unknown:
        raise ConfigError(f"unsupported drafter layer_types {sorted(unknown)}")
    if "sliding_attention" in types and not cfg.get("sliding_window"):
        raise ConfigError("drafter has sliding_attention layers but no sliding_window")
    return types


def _causal(cfg: dict, dflash: dict, arch: str, types: tuple[str, ...]) -> tuple[bool, ...]:
    override = dflash.get("causal", cfg.get("is_causal"))
    if arch == "muse":
        override = False
    if override is None:
        return tuple(t == "sliding_attention" for t in types)
    return (bool(override),) * len(types)


def parse_config(cfg: dict) -> DrafterConfig:
    """Turn a drafter `config.json` dict (either schema) into a `DrafterConfig`."""
    arch = _architecture(cfg)
    dflash = {k: v for k, v in (cfg.get("dflash_config") or {}).items() if k not in _TRAINING_ONLY_KEYS}
    refused = sorted(set(dflash) & _UNSUPPORTED_KEYS)
    if refused:
        raise ConfigError(f"dflash_config {', '.join(refused)} would change how the drafter runs, which this "
                          "runtime does not implement; refusing rather than ignoring")
    unknown = set(dflash) - _DFLASH_KEYS
    if unknown:
        raise ConfigError(f"unknown dflash_config keys {sorted(unknown)}; refusing to guess their meaning")
    if dflash.get("use_swa"):
        raise ConfigError("dflash_config.use_swa=true is not supported; use layer_types/sliding_window")
    for key in _REQUIRED:
        _require(cfg, key)
    n_layers = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, n_layers)
    theta, scaling = _rope(cfg)

    def pick(key, default=None):
        return dflash.get(key, cfg.get(key, default))

    ids = pick("target_layer_ids")
    mask_id = pick("mask_token_id")
    if ids is None or mask_id is None:
        raise ConfigError("drafter config needs target_layer_ids and mask_token_id")
    config = DrafterConfig(
        arch=arch,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rope_theta=theta,
        rope_scaling=scaling,
        layer_types=types,
        sliding_window=int(cfg["sliding_window"]) if "sliding_attention" in types else None,
        causal=_causal(cfg, dflash, arch, types),
        block_size=int(pick("block_size", 16)),
        mask_token_id=int(mask_id),
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=cfg.get("num_target_layers"),
        conv_kernel_size=int(dflash.get("conv_kernel_size", 0)),
        conv_group_size=int(dflash.get("conv_group_size", 0)),
        selector_rank=int(dflash.get("selector_rank", 0)),
        selector_top_k=int(dflash.get("selector_top_k", 0)),
        final_logit_softcapping=pick("final_logit_softcapping"),
        output_multiplier=float(dflash.get("output_multiplier", 1.0)),
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
    )
    _check_v2(config)
    return config


def _check_v2(c: DrafterConfig) -> None:
    if c.block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {c.block_size}")
    if not c.is_v2:
        return
    if c.conv_kernel_size < 1 or c.conv_group_size < 1:
        raise ConfigError(
            f"DFlash2 drafter needs conv_kernel_size and conv_group_size >= 1, got "
            f"{c.conv_kernel_size}, {c.conv_group_size}"
        )
    if c.hidden_size % c.conv_group_size:
        raise ConfigError(f"hidden_size {c.hidden_size} is not a multiple of conv_group_size {c.conv_group_size}")
    if not 1 <= c.selector_top_k <= c.vocab_size or c.selector_rank < 1:
        raise ConfigError(
            f"DFlash2 drafter needs selector_rank >= 1 and 1 <= selector_top_k <= vocab, got "
            f"{c.selector_rank}, {c.selector_top_k}"
        )


def check_fits(config: DrafterConfig, info, fc_width: int | None = None) -> None:
    """Fail before any forward pass if the drafter cannot run on this target.

    Args:
        info: the target's `TargetInfo`.
        fc_width: the in-features of the loaded `fc` weight, when known.
    """
    problems = []
    if config.hidden_size != info.hidden_size:
        problems.append(f"drafter hidden_size {config.hidden_size} != target hidden size {info.hidden_size}")
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < info.n_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} out of range for a target with {info.n_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != info.n_layers:
        problems.append(f"drafter was trained for {config.num_target_layers} target layers, target has {info.n_layers}")
    expected = len(config.target_layer_ids) * info.hidden_size
    if fc_width is not None and fc_width != expected:
        problems.append(
            f"fc.weight takes {fc_width} inputs, but {len(config.target_layer_ids)} taps x target hidden "
            f"{info.hidden_size} = {expected}"
        )
    if config.is_v2 and config.vocab_size != info.vocab_size:
        # v1 holds no vocab-sized tensor; v2's selector codebooks are indexed by target ids.
        problems.append(f"drafter vocab_size {config.vocab_size} != target vocab size {info.vocab_size}")
    if not 0 <= config.mask_token_id < info.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is outside the target vocab (size {info.vocab_size})")
    if info.embed_scale is None:
        problems.append("the target's layer-0 input is not a scaled embedding, so it cannot be shared")
    if problems:
        raise IncompatibleDrafterError("drafter does not fit the target: " + "; ".join(problems))
