"""Drafters we ship and write load elsewhere: transformers' AutoConfig (what SGLang and vLLM read
a drafter through) keeps the sliding window, non-causal attention, activation, RoPE base, layer
count and dflash_config; the top-level keys converters read are there; training-only keys load,
inference-changing ones are refused by name."""

import json
from pathlib import Path

import pytest

from dflash2_mlx.drafter.config import parse_config
from dflash2_mlx.drafter.load import save_drafter
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.train.export import export_drafter

from tiny import tiny_drafter

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent.parent / "models"
SHIPPED = [MODELS / "smollm2-135m-dflash2", MODELS / "smollm2-135m-dflash"]


def _written(tmp_path) -> list[Path]:
    out = []
    for arch in ("dflash2", "dflash"):
        d = save_drafter(tiny_drafter(None, arch, block_size=4), tmp_path / f"fit-{arch}")
        out += [d, export_drafter(d, tmp_path / f"export-{arch}", "bfloat16")]
    return out


def _check(path: Path) -> None:
    raw = json.loads((path / "config.json").read_text())
    ours = parse_config(raw)
    auto = transformers.AutoConfig.from_pretrained(str(path))
    assert auto.sliding_window == ours.sliding_window and auto.sliding_window is not None
    assert list(auto.layer_types) == list(ours.layer_types)
    assert auto.is_causal is False and auto.hidden_act == "silu" and auto.attention_bias is False
    assert auto.num_hidden_layers == ours.num_hidden_layers
    theta = getattr(auto, "rope_theta", None) or auto.rope_parameters["rope_theta"]
    assert theta == ours.rope_theta
    assert auto.dflash_config["target_layer_ids"] == list(ours.target_layer_ids)
    assert auto.dflash_config["mask_token_id"] == ours.mask_token_id
    assert raw["block_size"] == ours.block_size == auto.dflash_config["block_size"]
    assert raw["rope_theta"] == ours.rope_theta and raw["max_window_layers"] == 0
    if "torch_dtype" in raw:
        assert raw["dtype"] == raw["torch_dtype"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_drafters_keep_their_window_in_transformers(path):
    _check(path)


def test_written_and_exported_drafters_keep_their_window_in_transformers(tmp_path):
    for path in _written(tmp_path):
        _check(path)


def test_training_only_keys_load_and_inference_changing_ones_are_refused(tmp_path):
    raw = json.loads((SHIPPED[0] / "config.json").read_text())
    extra = dict(raw, dflash_config={**raw["dflash_config"], "num_anchors": 512, "loss_decay_gamma": 7.0,
                                     "backbone_rotary_base": 1e6})
    assert parse_config(extra) == parse_config(raw)
    for key in ("swa_window_size", "attention_sink_bias", "attention_value_scale"):
        bad = dict(raw, dflash_config={**raw["dflash_config"], key: 1})
        with pytest.raises(ConfigError, match=key):
            parse_config(bad)
