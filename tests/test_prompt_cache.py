"""A reused prompt cache gives exactly a cold run's output, for every cache kind the engine has."""

import mlx.core as mx
import pytest

from dflash2_mlx import SamplingParams, generate, stream_generate
from dflash2_mlx.core.prompt_cache import PromptCache
from dflash2_mlx.errors import ConfigError

from tiny import tiny_drafter, tiny_target

P1 = [1, 5, 9, 14, 3, 22, 7, 31, 40, 12, 18, 6, 27, 33, 8, 11, 19, 25]
USER2 = [44, 2, 17, 29, 35, 4, 13]
OTHER = [50, 51, 23, 61, 70, 15, 38, 9]
N = 20


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5", "gemma3_text"])
def target(request):
    return tiny_target(request.param)  # gemma3_text: window 8, so every turn runs past it


def _cold(target, drafter, prompt, **kw):
    return generate(target, prompt, drafter=drafter, max_tokens=N, block_size=4, **kw).tokens


def _hot(target, drafter, prompt, cache, **kw):
    return generate(target, prompt, drafter=drafter, max_tokens=N, block_size=4, prompt_cache=cache, **kw).tokens


@pytest.mark.parametrize("reserve", [4, 64])
@pytest.mark.parametrize("arch", ["dflash", "dflash2", None])
def test_turns_with_a_prompt_cache_equal_cold_runs(target, arch, reserve):
    drafter = tiny_drafter(target, arch, block_size=4) if arch else None
    cache = PromptCache(target, drafter, reserve=reserve)
    first = _hot(target, drafter, P1, cache)
    assert first == _cold(target, drafter, P1)
    covered = P1 + first
    assert cache.tokens == covered[: len(cache.tokens)] and len(cache.tokens) >= len(covered) - 1

    turns = [
        P1 + first + USER2,  # a chat's next turn: everything before is shared
        P1 + first[:-3] + OTHER,  # the reply re-templated: a few tokens cut
        P1[:6] + OTHER,  # only the start shared
        P1[:6] + OTHER,  # the same prompt again
    ]
    for prompt in turns:
        before = list(cache.tokens)
        hot = _hot(target, drafter, prompt, cache)
        assert hot == _cold(target, drafter, prompt), (prompt, cache.last_reuse)
        reuse = cache.last_reuse
        shared = min(next((i for i, (a, b) in enumerate(zip(before, prompt)) if a != b), len(before)),
                     len(prompt) - 1)
        assert reuse.n_cached <= shared and (reuse.n_cached == shared or reuse.how in ("mark", "cold"))
    assert cache.last_reuse.n_cached == len(turns[-1]) - 1  # a repeat always hits: the mark is there


def test_a_cold_run_and_a_cache_hit_score_the_first_token_bit_for_bit(target):
    """Both feed the last prompt token in a pass of its own (as mlx-lm does), so a near-tie
    cannot fall one way cold and the other way from the cache."""
    cache = PromptCache(target, None)

    def first_logprobs(prompt_cache):
        events = stream_generate(target, P1, max_tokens=1, prompt_cache=prompt_cache, top_logprobs=8)
        return [(lp.logprob, lp.top) for ev in events for lp in ev.logprobs]

    first_logprobs(cache)
    assert cache.tokens[: len(P1) - 1] == P1[:-1]
    hot = first_logprobs(cache)
    assert cache.last_reuse.n_cached == len(P1) - 1
    assert hot == first_logprobs(None)


def test_exact_kinds_trim_and_others_fall_back_to_the_mark(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4, layer_types=["full_attention"] * 2)
    cache = PromptCache(target, drafter, reserve=4)
    _hot(target, drafter, P1, cache)
    _hot(target, drafter, P1[:6] + OTHER, cache)
    # gemma3's window layers still hold the cut rows (their buffer has not wrapped): exact too
    kinds = {"llama": "trim", "qwen3": "trim", "qwen3_5_text": "cold", "gemma3_text": "trim"}
    assert cache.last_reuse.how == kinds[target.model_type]
    if cache.last_reuse.how == "cold":
        assert "cannot drop" in cache.last_reuse.reason


def test_a_window_cache_trims_only_the_rows_it_holds():
    from dflash2_mlx.core.cache_kinds import can_trim
    from dflash2_mlx.core.caches import WindowKVCache

    c = WindowKVCache(window=8, reserve=2)
    row = mx.zeros((1, 1, 1, 4))
    while c.offset < 2 or c.n_stored == c.offset:  # until the buffer fills and old rows go
        c.update_and_fetch(row, row)
    assert c.n_stored == 10
    assert can_trim(c, 3) and not can_trim(c, 4)  # 7 rows must stay for the window


@pytest.mark.parametrize("kind", ["window", "kv"])
def test_a_restored_or_cloned_cache_takes_new_rows(kind):
    from mlx_lm.models.cache import KVCache

    from dflash2_mlx.core.cache_kinds import clone, restore, snapshot
    from dflash2_mlx.core.caches import WindowKVCache

    def make():
        return WindowKVCache(window=8, reserve=4) if kind == "window" else KVCache()

    rows = mx.arange(5 * 4, dtype=mx.float32).reshape(1, 1, 5, 4)
    ref, c = make(), make()
    for cache in (ref, c):
        cache.update_and_fetch(rows, rows)
    snap = snapshot(c)
    c.update_and_fetch(rows + 100, rows + 100)
    restore(c, snap)
    copy = clone(c)
    want = ref.update_and_fetch(rows + 7, rows + 7)[0]
    for cache in (c, copy):  # each writes its own rows; the snapshot and the other stay whole
        got = cache.update_and_fetch(rows + 7, rows + 7)[0]
        assert mx.array_equal(got, want)


def test_sampling_with_a_seed_is_the_same_cached_and_cold(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=11)
    cache = PromptCache(target, drafter, reserve=4)
    first = _hot(target, drafter, P1, cache, sampling=sampling)
    assert first == _cold(target, drafter, P1, sampling=sampling)
    second = P1 + first + USER2
    assert _hot(target, drafter, second, cache, sampling=sampling) == _cold(target, drafter, second, sampling=sampling)


def test_a_reply_closed_early_leaves_the_cache_usable(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    cache = PromptCache(target, drafter)
    events = stream_generate(target, P1, drafter=drafter, max_tokens=N, block_size=4, prompt_cache=cache)
    got = [t for _, ev in zip(range(3), events) for t in ev.tokens]
    events.close()
    assert cache.tokens == (P1 + got)[: len(cache.tokens)]
    prompt = P1 + got + USER2
    assert _hot(target, drafter, prompt, cache) == _cold(target, drafter, prompt)
    assert cache.last_reuse.n_cached >= len(P1)


def test_events_report_the_cached_tokens(target):
    cache = PromptCache(target, None)
    first = list(stream_generate(target, P1, max_tokens=4, prompt_cache=cache))
    assert first[0].cached_tokens == 0
    again = list(stream_generate(target, P1 + USER2, max_tokens=4, prompt_cache=cache))
    assert again[0].cached_tokens == cache.last_reuse.n_cached > 0
    assert again[0].prompt_tokens == len(P1 + USER2)


def test_a_cache_for_another_pair_or_width_is_refused():
    target, other = tiny_target("llama"), tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    with pytest.raises(ConfigError, match="another target"):
        generate(target, P1, drafter=drafter, max_tokens=2, prompt_cache=PromptCache(other, None))
    with pytest.raises(ConfigError, match="another target"):
        generate(target, P1, drafter=drafter, max_tokens=2, prompt_cache=PromptCache(target, None))
    with pytest.raises(ConfigError, match="reserve 4"):
        generate(target, P1, drafter=drafter, max_tokens=2, block_size=6,
                 prompt_cache=PromptCache(target, drafter, reserve=4))


def test_nbytes_counts_the_caches():
    target = tiny_target("gemma3_text")
    cache = PromptCache(target, tiny_drafter(target, "dflash2", block_size=4))
    assert cache.nbytes == 0
    _hot(target, cache.drafter, P1, cache)
    kv = sum(c.keys.nbytes + c.values.nbytes for c in cache.target_cache)
    assert cache.nbytes > kv > 0
    cache.reset()
    assert cache.nbytes == 0 and cache.tokens == []


def test_a_saved_and_loaded_cache_continues_exactly(target, tmp_path):
    from dflash2_mlx.core.prompt_cache import load_prompt_cache, save_prompt_cache

    drafter = tiny_drafter(target, "dflash2", block_size=4)
    drafter.path = "tiny-drafter"
    cache = PromptCache(target, drafter)
    first = _hot(target, drafter, P1, cache)
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", target, drafter)
    assert loaded.tokens == cache.tokens and loaded.nbytes > 0
    prompt = P1 + first + USER2
    assert _hot(target, drafter, prompt, loaded) == _cold(target, drafter, prompt)
    assert loaded.last_reuse.n_cached == len(cache.tokens)
    with pytest.raises(ConfigError, match="not tiny-"):
        load_prompt_cache(tmp_path / "c.safetensors", target, None)
    (tmp_path / "bad.safetensors").write_bytes(b"nonsense")
    with pytest.raises(ConfigError, match="not a dflash2 prompt cache"):
        load_prompt_cache(tmp_path / "bad.safetensors", target, drafter)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_an_entry_reports_everything_it_keeps_alive(family):
    import gc

    target = tiny_target(family)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    prompt = [1] + [(7 * j) % 90 + 3 for j in range(200)]
    generate(target, prompt, drafter=drafter, max_tokens=N, block_size=4)  # warm: compiled, allocated
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = PromptCache(target, drafter, reserve=4)
    generate(target, prompt, drafter=drafter, max_tokens=N, block_size=4, prompt_cache=cache)
    assert cache._mark is not None  # a hybrid or window target keeps a snapshot before the last prompt token
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    assert cache.nbytes >= 0.9 * held, (cache.nbytes, held)
