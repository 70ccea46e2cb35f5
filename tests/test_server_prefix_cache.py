"""The server's prefix cache: a chat's later turns reuse the earlier ones' caches, exactly.

The pool in-process (LRU order, byte bound, hits and misses), then `dflash2 serve` as a real
process: a multi-turn chat gives the same replies as a server with the cache off, reports
`cached_tokens` in each API's usage and counts hits in /metrics.
"""

from __future__ import annotations

import openai
import pytest
from test_server_harness import ServerProcess, metrics, write_pair

from dflash2_mlx import generate
from dflash2_mlx.core.prompt_cache import PromptCache
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.paths import parse_bytes
from dflash2_mlx.server.cache_pool import PromptCachePool

from tiny import tiny_drafter, tiny_target

A = [1, 5, 9, 14, 3, 22, 7, 31, 40, 12]
B = [2, 60, 61, 62, 63, 64, 65, 66]
C = [3, 70, 71, 72, 73, 74]


def _turn(pool, target, drafter, prompt):
    cache = pool.checkout(prompt)
    out = generate(target, prompt, drafter=drafter, max_tokens=12, block_size=4, prompt_cache=cache).tokens
    pool.checkin(cache)
    return out


def test_pool_reuses_the_longest_prefix_and_evicts_oldest_first():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    probe = PromptCache(target, drafter)
    generate(target, A, drafter=drafter, max_tokens=12, block_size=4, prompt_cache=probe)
    one = probe.nbytes  # what one short conversation holds
    pool = PromptCachePool(lambda: PromptCache(target, drafter), max_bytes=int(2.5 * one))
    first = {name: _turn(pool, target, drafter, p) for name, p in (("a", A), ("b", B))}
    assert pool.stats.misses == 2 and pool.stats.entries == 2
    again = _turn(pool, target, drafter, A + first["a"] + [20, 21])  # conversation A goes on
    assert pool.stats.hits == 1 and pool.stats.cached_tokens >= len(A) + len(first["a"]) - 1
    assert again == generate(target, A + first["a"] + [20, 21], drafter=drafter, max_tokens=12, block_size=4).tokens
    _turn(pool, target, drafter, C)  # a third: the least recently used (B) goes
    snap = pool.snapshot()
    assert snap.evictions >= 1 and snap.bytes <= pool.max_bytes
    assert all(cache.tokens[: len(B)] != B for cache in pool._entries.values())
    assert any(cache.tokens[: len(A)] == A for cache in pool._entries.values())


def test_a_request_sharing_less_than_the_last_prompt_works_on_a_copy():
    target = tiny_target("qwen3_5")  # recurrent: the copy must not share state that the original updates
    drafter = tiny_drafter(target, block_size=4)
    pool = PromptCachePool(lambda: PromptCache(target, drafter))
    first = _turn(pool, target, drafter, A)
    other = A[:5] + [80, 81, 82, 83]
    assert (_turn(pool, target, drafter, other)
            == generate(target, other, drafter=drafter, max_tokens=12, block_size=4).tokens)
    assert pool.stats.entries == 2
    cont = A + first + [20, 21]
    assert (_turn(pool, target, drafter, cont)
            == generate(target, cont, drafter=drafter, max_tokens=12, block_size=4).tokens)
    assert pool._entries[next(reversed(pool._entries))].last_reuse.n_cached >= len(A) + len(first) - 1


def test_an_entry_bigger_than_the_bound_is_not_kept():
    target = tiny_target("llama")
    pool = PromptCachePool(lambda: PromptCache(target, None), max_bytes=1)
    _turn(pool, target, None, A)
    assert pool.snapshot().entries == 0 and pool.snapshot().evictions == 1


def test_zero_bytes_turns_the_cache_off():
    pool = PromptCachePool(lambda: None, max_bytes=0)
    assert pool.checkout(A) is None and not pool.enabled


@pytest.mark.parametrize("text,value", [("2GiB", 2 << 30), ("512MB", 512 * 10**6), ("0", 0), ("1.5k", 1500)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_names_the_bad_value():
    with pytest.raises(ConfigError, match="--prompt-cache-bytes.*'lots'"):
        parse_bytes("lots", "--prompt-cache-bytes")


# -- through `dflash2 serve` ----------------------------------------------------------------

SYSTEM = "You are terse. " * 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


def _chat(url: str, turns: int = 3):
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} plus {i}?"})
        reply = oa.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12)
        text = reply.choices[0].message.content
        replies.append((text, reply.usage))
        messages.append({"role": "assistant", "content": text})
    return replies


def test_a_chat_reuses_its_history_and_replies_as_without_the_cache(pair, tmp_path):
    with ServerProcess(*pair, "--prompt-cache-bytes", "0", log_path=tmp_path / "cold.log") as cold:
        reference = _chat(cold.url)
    with ServerProcess(*pair, log_path=tmp_path / "hot.log") as hot:
        replies = _chat(hot.url)
        counts = metrics(hot.url)
    assert [text for text, _ in replies] == [text for text, _ in reference]
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in reference)
    assert replies[0][1].prompt_tokens_details.cached_tokens == 0
    for (_, before), (_, usage) in zip(replies, replies[1:]):
        # the previous prompt at least, up to the reply the template wrote back
        assert before.prompt_tokens - 1 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert counts["dflash2_prompt_cache_hits_total"] == 2 and counts["dflash2_prompt_cache_misses_total"] == 1
    assert counts["dflash2_prompt_cache_tokens_total"] == sum(u.prompt_tokens_details.cached_tokens
                                                              for _, u in replies)
    assert counts["dflash2_prompt_cache_entries"] == 1 and counts["dflash2_prompt_cache_bytes"] > 0


def test_ollama_reports_the_cached_part_in_timings(pair, tmp_path):
    import json

    from test_server_harness import request

    with ServerProcess(*pair, log_path=tmp_path / "ollama.log") as server:
        body = {"model": "tiny-llama", "stream": False, "messages": [{"role": "user", "content": "Hi there"}],
                "options": {"num_predict": 6}}
        first = json.loads(request(server.url, "POST", "/api/chat", body).body)
        second = json.loads(request(server.url, "POST", "/api/chat", body).body)
    assert first["timings"]["cache_n"] == 0
    assert second["timings"]["cache_n"] == second["prompt_eval_count"] - 1
    assert second["message"]["content"] == first["message"]["content"]
