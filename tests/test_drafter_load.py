"""Drafter checkpoints: the published config keys and tensor names load; bad ones fail clearly."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash2_mlx import load_drafter
from dflash2_mlx.drafter.config import parse_config
from dflash2_mlx.drafter.load import save_drafter
from dflash2_mlx.drafter.model import Drafter
from dflash2_mlx.errors import ConfigError, IncompatibleDrafterError, WeightsError

from tiny import HIDDEN, VOCAB, tiny_drafter, tiny_target


def published_v2_config(**over):
    """The key set of z-lab/Qwen3.8-27B-DFlash2's config.json, with tiny sizes."""
    cfg = {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "is_causal": False,
        "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 96,
                          "selector_rank": 16, "selector_top_k": 8, "target_layer_ids": [0, 2, 3]},
        "dtype": "bfloat16", "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": 96,
        "layer_types": ["sliding_attention"] * 2, "max_position_embeddings": 4096, "max_window_layers": 2,
        "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "num_target_layers": 4, "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "sliding_window": 16,
        "tie_word_embeddings": False, "transformers_version": "5.15.0", "use_cache": False,
        "use_sliding_window": True, "vocab_size": VOCAB,
    }
    cfg.update(over)
    return cfg


def published_v2_tensors(n_layers=2, H=HIDDEN, inter=96, q=64, kv=32, d=16, r=16, V=VOCAB, taps=3, G=16, K=2):
    """Tensor names and shapes of the published DFlash 2 safetensors header, tiny sizes."""
    shapes = {
        "candidate_selector.hidden_projection.weight": (r, H),
        "candidate_selector.predecessor_codebook": (V, r),
        "candidate_selector.successor_codebook": (V, r),
        "fc.weight": (H, taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_conv.base_kernel": (2, K, H),
            p + "attention_conv.kernel_projection.weight": (2 * K * H // G, H),
            p + "mlp_conv.base_kernel": (2, K, H), p + "mlp_conv.kernel_projection.weight": (2 * K * H // G, H),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "mlp.down_proj.weight": (H, inter), p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
        })
    return shapes


def write_checkpoint(path, cfg, shapes, drop=(), add=(), reshape=None):
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    tensors = {k: (mx.random.normal(s) * 0.05).astype(mx.bfloat16) for k, s in shapes.items() if k not in drop}
    for k in add:
        tensors[k] = mx.zeros((4,), dtype=mx.bfloat16)
    for k, s in (reshape or {}).items():
        tensors[k] = mx.zeros(s, dtype=mx.bfloat16)
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def test_published_layout_loads_and_drafts(tmp_path, target):
    ckpt = write_checkpoint(tmp_path / "d", published_v2_config(), published_v2_tensors())
    drafter = load_drafter(ckpt, target, dtype="float32")
    assert drafter.config.is_v2 and drafter.config.block_size == 8 and drafter.config.causal == (False, False)
    proposal = drafter.draft_from(mx.array([5]), mx.zeros((1, 3, 3 * HIDDEN)), drafter.make_cache(), 8)
    assert proposal.tokens.shape == (1, 7) and proposal.candidates.shape == (1, 7, 8)


def test_real_published_dims_map_onto_every_parameter():
    """Muse-Glimmer-30B-DFlash2 dims: our parameters are exactly the published tensor set."""
    cfg = published_v2_config(hidden_size=6656, intermediate_size=19968, num_hidden_layers=5, head_dim=128,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=202048,
                              layer_types=["sliding_attention"] * 5, sliding_window=2048, num_target_layers=52)
    cfg["dflash_config"].update(selector_rank=256, selector_top_k=16, target_layer_ids=[1, 13, 25, 37, 49])
    model = Drafter(parse_config(cfg))  # lazily initialised: nothing is materialised
    ours = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    published = published_v2_tensors(5, 6656, 19968, 4096, 1024, 128, 256, 202048, 5)
    renamed = {(k + ".weight" if k.endswith("codebook") else k): s for k, s in published.items()}
    assert ours == renamed


def test_legacy_schema_and_meta_assistant_parse():
    legacy = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "vocab_size": 97, "rope_theta": 1e6, "block_size": 16, "num_target_layers": 4,
              "dflash_config": {"mask_token_id": 96, "target_layer_ids": [1]}}
    c = parse_config(legacy)
    assert (c.block_size, c.rope_theta, c.head_dim, c.causal) == (16, 1e6, 16, (False,))
    muse = {"architectures": ["MuseGlimmerAssistantModel"], "block_size": 16, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 97, "head_dim": 16, "mask_token_id": 96,
            "layer_types": ["sliding_attention"] * 2, "sliding_window": 2048, "target_layer_ids": [1, 2],
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    m = parse_config(muse)
    assert (m.arch, m.block_size, m.mask_token_id, m.causal, m.rope_theta) == ("muse", 16, 96, (False, False), 5e5)


def test_meta_assistant_tensor_names_load(tmp_path, target):
    cfg = {"architectures": ["MuseGlimmerAssistantModel"], "block_size": 4, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "vocab_size": 97, "head_dim": 16, "mask_token_id": 96,
           "layer_types": ["sliding_attention"] * 2, "sliding_window": 32, "target_layer_ids": [1, 2, 3],
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    shapes = {k: s for k, s in published_v2_tensors().items() if "conv" not in k and "selector" not in k}
    shapes["encoder.fc.weight"] = shapes.pop("fc.weight")
    shapes["encoder.output_norm_enc.weight"] = shapes.pop("hidden_norm.weight")
    drafter = load_drafter(write_checkpoint(tmp_path / "m", cfg, shapes), target)
    assert drafter.config.arch == "muse" and not drafter.config.is_v2


@pytest.mark.parametrize("case,match", [
    ("missing", r"missing tensors \['layers.1.mlp_conv.base_kernel'\]"),
    ("extra", r"unexpected tensors \['lm_head.weight'\]"),
    ("fc_width", r"fc.weight takes 256 inputs, but 3 taps x target hidden 64 = 192"),
    ("layer_id", r"target_layer_ids \[7\] out of range for a target with 4 layers"),
    ("hidden", r"drafter hidden_size 48 != target hidden size 64"),
    ("dflash_key", r"unknown dflash_config keys \['future_knob'\]"),
])
def test_bad_checkpoints_fail_naming_values(tmp_path, target, case, match):
    cfg, shapes, kw = published_v2_config(), published_v2_tensors(), {}
    if case == "missing":
        kw["drop"] = ["layers.1.mlp_conv.base_kernel"]
    elif case == "extra":
        kw["add"] = ["lm_head.weight"]
    elif case == "fc_width":
        kw["reshape"] = {"fc.weight": (HIDDEN, 256)}
    elif case == "layer_id":
        cfg["dflash_config"]["target_layer_ids"] = [0, 2, 7]
    elif case == "hidden":
        cfg.update(hidden_size=48, num_attention_heads=3)
        shapes = published_v2_tensors(H=48, q=48, taps=3)
    elif case == "dflash_key":
        cfg["dflash_config"]["future_knob"] = 1
    with pytest.raises((WeightsError, IncompatibleDrafterError, ConfigError), match=match):
        load_drafter(write_checkpoint(tmp_path / case, cfg, shapes, **kw), target)


def test_save_then_load_roundtrip_in_published_layout(tmp_path, target):
    drafter = tiny_drafter(target, "dflash2")
    out = save_drafter(drafter, tmp_path / "saved")
    names = set(mx.load(str(out / "model.safetensors")))
    assert names == set(published_v2_tensors())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "selector_rank" in cfg["dflash_config"]
    again = load_drafter(out, target)
    ctx = mx.ones((1, 4, 3 * HIDDEN))
    a = drafter.draft_from(mx.array([5]), ctx, drafter.make_cache(), 6).tokens
    b = again.draft_from(mx.array([5]), ctx, again.make_cache(), 6).tokens
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("bits", [4, 8])
def test_draft_bits_quantizes_and_still_drafts(tmp_path, target, bits):
    ckpt = write_checkpoint(tmp_path / "q", published_v2_config(), published_v2_tensors())
    drafter = load_drafter(ckpt, target, draft_bits=bits, dtype="float32")
    assert type(drafter.fc).__name__ == "QuantizedLinear" and drafter.fc.bits == bits
    out = drafter.draft_from(mx.array([5]), mx.ones((1, 3, 3 * HIDDEN)), drafter.make_cache(), 4)
    assert out.tokens.shape == (1, 3)
    with pytest.raises(ConfigError, match="draft_bits must be 4 or 8, got 3"):
        load_drafter(ckpt, target, draft_bits=3)


def test_quantized_draft_head_keeps_output_exact(target):
    from dflash2_mlx import generate

    drafter = tiny_drafter(target, "dflash2")
    dense_logits = drafter.logits(mx.ones((1, 2, HIDDEN)))
    assert drafter.quantize_head(8)
    assert drafter._draft_head is not None and "_draft_head" not in dict(tree_flatten(drafter.parameters()))
    q_logits = drafter.logits(mx.ones((1, 2, HIDDEN)))
    assert 0 < float(mx.abs(q_logits - dense_logits).max()) < 0.5  # a quantized copy, not the same array
    prompt = [1, 40, 41, 42, 7, 19]
    assert (generate(target, prompt, drafter=drafter, max_tokens=24).tokens
            == generate(target, prompt, max_tokens=24).tokens)
