"""Quantized K/V (`--kv-bits`): speculation equals plain decoding under the same quantization,
for every cache kind mlx-lm can quantize; prompt caches reuse and save quantized entries; the
combinations that cannot work are refused by name."""

import pytest
from mlx_lm.models.cache import QuantizedKVCache
from typer.testing import CliRunner

from dflash2_mlx import SamplingParams, generate
from dflash2_mlx.cli import app
from dflash2_mlx.core.prompt_cache import PromptCache, load_prompt_cache, save_prompt_cache
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.server import ServerConfig, create_app

from tiny import FAMILIES, save_tiny_pair, tiny_drafter, tiny_target

PROMPT = [1, 5, 9, 14, 3, 22, 7, 31, 40, 12, 18, 6, 27, 33, 8, 11]
USER2 = [44, 2, 17, 29, 35, 4, 13]
N = 24


def _target(family: str):
    if family == "qwen3_5":  # hybrid: recurrent layers stay as they are, attention layers quantize
        return tiny_target(family, text_config=dict(FAMILIES[family]["text_config"], head_dim=32))
    return tiny_target(family, head_dim=32)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5"])
def target(request):
    return _target(request.param)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_speculation_equals_plain_decoding_under_the_same_quantization(target, bits, group):
    kv = dict(kv_bits=bits, kv_group_size=group)
    plain = generate(target, PROMPT, max_tokens=N, **kv)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    assert generate(target, PROMPT, drafter=drafter, max_tokens=N, block_size=4, **kv).tokens == plain.tokens
    cache = target.make_cache(kv_bits=bits, kv_group_size=group)
    quantized = [c for c in cache if isinstance(getattr(c, "inner", c), QuantizedKVCache)
                 or isinstance(c, QuantizedKVCache)]
    assert quantized, [type(c).__name__ for c in cache]


def test_seeded_sampling_with_quantized_kv_repeats_and_speculation_keeps_the_distribution(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    params = SamplingParams(temperature=0.8, seed=7)
    a = generate(target, PROMPT, drafter=drafter, max_tokens=N, block_size=4, sampling=params, kv_bits=8)
    b = generate(target, PROMPT, drafter=drafter, max_tokens=N, block_size=4, sampling=params, kv_bits=8)
    assert a.tokens == b.tokens and len(a.tokens) == N


def test_a_quantized_prompt_cache_reuses_its_prefix_and_survives_save_and_load(target, tmp_path):
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    cache = PromptCache(target, drafter, reserve=8, kv_bits=8)
    first = generate(target, PROMPT, drafter=drafter, max_tokens=N, block_size=4, prompt_cache=cache).tokens
    assert first == generate(target, PROMPT, max_tokens=N, kv_bits=8).tokens
    turn = PROMPT + first + USER2
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path, target, drafter)
    assert (loaded.kv_bits, loaded.kv_group_size) == (8, 32)
    cold = generate(target, turn, max_tokens=N, kv_bits=8).tokens
    for c in (cache, loaded):
        hot = generate(target, turn, drafter=drafter, max_tokens=N, block_size=4, prompt_cache=c)
        assert hot.tokens == cold
        assert c.last_reuse.n_cached >= len(PROMPT)
    with pytest.raises(ConfigError, match="kv_bits 4 differs from the prompt cache's 8"):
        generate(target, turn, drafter=drafter, max_tokens=4, block_size=4, prompt_cache=cache, kv_bits=4)


def test_a_quantized_entry_counts_its_real_size():
    target = _target("llama")
    sizes = {}
    for bits in (None, 8, 4):
        cache = PromptCache(target, None, reserve=4, kv_bits=bits)
        generate(target, PROMPT * 8, max_tokens=4, prompt_cache=cache)
        sizes[bits] = cache.nbytes
    # 8-bit keeps 1 byte per value plus a scale and bias per group of 32 (fp32 here): 1.25 of 4 bytes
    assert sizes[8] < 0.4 * sizes[None] and sizes[4] < 0.7 * sizes[8], sizes


def test_refusals_name_the_value_and_the_layer_kind():
    llama = _target("llama")
    with pytest.raises(ConfigError,
                       match="kv_group_size must be 32, 64 or 128 and divide the head dimension 32, got 64"):
        llama.make_cache(kv_bits=8, kv_group_size=64)
    with pytest.raises(ConfigError, match="--kv-group-size 32 needs --kv-bits"):
        llama.make_cache(kv_group_size=32)
    gemma = tiny_target("gemma3_text", head_dim=32)
    with pytest.raises(ConfigError, match="layer 0 of gemma3_text is a sliding-window layer .RotatingKVCache."):
        gemma.make_cache(kv_bits=8)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantized_rows_of_a_batch_equal_plain_decoding_under_the_same_quantization(target, bits, group):
    from test_batch_engine import LENGTHS, PROMPTS, _run

    from dflash2_mlx.core import batch_cache
    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    kv = dict(kv_bits=bits, kv_group_size=group)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    for batch in (SpeculativeBatch(target, drafter, prefill_step_size=4, **kv), SpeculativeBatch(target, None, **kv)):
        out = _run(batch, [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)])  # rows join over several steps
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            assert out[i][:-1] == generate(target, p, n, **kv).tokens, i
        assert not batch.rows and batch_cache.batch_size(batch.cache) == 0
    ragged = [c for c in batch_cache.empty_batch(target, **kv) if hasattr(c, "quantized")]
    assert ragged and all(c.quantized == (target.kv_group_size(bits, group), bits) for c in ragged)


def test_batched_rows_read_quantized_k_v_as_a_row_alone_does_under_the_gpu_rule(monkeypatch):
    """Off the CPU a short pass reads the groups through mlx-lm's quantized attention (no float
    copy); run here with that rule, batched rows must take the same path and equal plain decoding."""
    from mlx_lm.models import base
    from test_batch_engine import LENGTHS, PROMPTS, _run

    from dflash2_mlx.core import kv_attention
    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    monkeypatch.setattr(kv_attention, "float_reads", lambda n, device=None: n >= kv_attention.LONG_PASS)
    batched = []
    quantized_attention = base.quantized_scaled_dot_product_attention

    def spy(queries, *args, **kwargs):
        batched.append(queries.shape[0] > 1)
        return quantized_attention(queries, *args, **kwargs)

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", spy)
    target = _target("qwen3")
    plain = [generate(target, p, n, kv_bits=8).tokens for p, n in zip(PROMPTS, LENGTHS)]
    assert batched and not any(batched)  # a row alone took the quantized path
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    out = _run(SpeculativeBatch(target, drafter, prefill_step_size=4, kv_bits=8),
               [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)], join_every=1)
    assert [out[i][:-1] for i in range(len(PROMPTS))] == plain
    assert any(batched)  # and so did the batch's rows


def test_quantized_rows_keeping_different_prefixes_and_packed_equal_plain_decoding(monkeypatch):
    from test_batch_engine import LENGTHS, PROMPTS, ScriptedRows, _run

    from dflash2_mlx.core import batch_engine, ragged
    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    monkeypatch.setattr(ragged, "COMPACT_MIN_SLOTS", 8)  # pack holes often
    monkeypatch.setattr(batch_engine, "COMPACT_EVERY", 2)
    target = _target("llama")
    plain = [generate(target, p, n, kv_bits=8).tokens for p, n in zip(PROMPTS, LENGTHS)]
    drafter = ScriptedRows(target, [p + t + [3] * 20 for p, t in zip(PROMPTS, plain)], 5)
    packed = []
    compact = ragged.RaggedKVCache.compact
    monkeypatch.setattr(ragged.RaggedKVCache, "compact", lambda self: packed.append(compact(self)) or packed[-1])
    out = _run(SpeculativeBatch(target, drafter, prefill_step_size=64, kv_bits=8),
               [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)], join_every=1)
    assert [out[i][:-1] for i in range(len(PROMPTS))] == plain
    assert any(packed)


def test_a_quantized_rows_caches_go_back_into_its_prompt_cache_quantized(target):
    from test_batch_engine import PROMPTS, _run

    from dflash2_mlx.core.batch_engine import SpeculativeBatch

    drafter = tiny_drafter(target, "dflash2", block_size=4)
    cache = PromptCache(target, drafter, reserve=8, kv_bits=8)
    batch = SpeculativeBatch(target, drafter, kv_bits=8)
    reply = _run(batch, [(PROMPTS[0], 20, {"prompt_cache": cache}), (PROMPTS[1], 30, {})], join_every=1)[0][:-1]
    assert any(type(c) is QuantizedKVCache for c in cache.target_cache)
    turn = PROMPTS[0] + reply + [44, 45]
    warm = generate(target, turn, 12, drafter=drafter, prompt_cache=cache)
    assert warm.cached_tokens >= len(PROMPTS[0]) + 10
    assert warm.tokens == generate(target, turn, 12, kv_bits=8).tokens


def test_serve_batches_quantized_kv_rows(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from dflash2_mlx.core.ragged import RaggedKVCache
    from dflash2_mlx.server.cache_pool import PromptCachePool
    from dflash2_mlx.server.worker import GenerationWorker, Job
    from dflash2_mlx.session import Session

    target = _target("llama")
    spec = SimpleNamespace(name="tiny", target="/nowhere/tiny", drafter="/nowhere/drafter", defaults={}, notes=[])
    session = Session(spec=spec, target=target, drafter=tiny_drafter(target, block_size=4), block_size=None,
                      kv_bits=8, kv_group_size=32)
    assert create_app(session, ServerConfig()) is not None
    joined = []
    add_rows = RaggedKVCache.add_rows
    monkeypatch.setattr(RaggedKVCache, "add_rows",
                        lambda self, rows: joined.append(self.quantized) or add_rows(self, rows))

    first = generate(target, PROMPT, max_tokens=N, kv_bits=8).tokens
    turn = PROMPT + first + USER2
    other = [1, 60, 61, 62, 63]

    async def main():
        worker = GenerationWorker(session, capacity=4, max_batch=4,
                                  prompt_caches=PromptCachePool(session.prompt_cache, 1 << 30))
        worker.start()
        out = []
        for prompts in ([PROMPT, other], [turn, other]):  # two rows at once; the turn reuses its quantized entry
            jobs = [Job(list(p), SamplingParams(), N, [], asyncio.get_running_loop()) for p in prompts]
            for job in jobs:
                worker.submit(job)
            for job in jobs:
                events = [e async for e in job.events()]
                out.append(([t for e in events for t in e.tokens], job.stats.cached_tokens))
        worker.close()
        return out

    (a, _), (b, _), (c, cached), (d, _) = asyncio.run(main())
    assert a == first and c == generate(target, turn, max_tokens=N, kv_bits=8).tokens
    assert b == d == generate(target, other, max_tokens=N, kv_bits=8).tokens
    assert cached >= len(PROMPT)
    assert (32, 8) in joined  # the rows decoded together, quantized


def test_run_cli_decodes_with_quantized_kv(tmp_path):
    import json

    target_dir, drafter_dir = save_tiny_pair(tmp_path, "llama", target_overrides={"head_dim": 32})
    args = ["run", str(target_dir), "-d", str(drafter_dir), "--no-chat-template", "abc",
            "-n", "12", "--kv-bits", "8", "--block-size", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    spec = json.loads(result.stdout)
    plain = CliRunner().invoke(app, args[:2] + ["-d", "none"] + args[4:])
    assert plain.exit_code == 0, plain.output
    assert spec["kv_bits"] == 8 and spec["kv_group_size"] == 32
    assert spec["token_ids"] == json.loads(plain.stdout)["token_ids"]
    bad = CliRunner().invoke(app, args[:-1] + ["--kv-group-size", "48"])
    assert bad.exit_code == 2 and "kv_group_size must be 32, 64 or 128" in bad.stderr


def test_a_quantized_batch_refuses_a_full_precision_row_and_a_window():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from dflash2_mlx.core.ragged import RaggedKVCache

    row = KVCache()
    row.update_and_fetch(mx.ones((1, 1, 3, 32)), mx.ones((1, 1, 3, 32)))
    with pytest.raises(ValueError, match="a row with full-precision K/V cannot join a batch of quantized K/V"):
        RaggedKVCache(quantized=(32, 8)).add_rows([(*row.state, mx.arange(3)[None], 3)])
    with pytest.raises(ValueError, match="a sliding-window layer \\(window 8\\) cannot hold quantized K/V"):
        RaggedKVCache(window=8, quantized=(32, 8))
