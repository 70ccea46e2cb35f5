"""Concurrent requests decode in one batch (a row alone on its own caches); seeded ones run solo.

In-process worker over tiny targets of every cache kind the batch must carry (KV, sliding
window, recurrent): rows join while others run, finish at different lengths, sample at their
own temperature, and one is cancelled; every greedy row equals its single-stream output.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dflash2_mlx.core.sampling import SamplingParams
from dflash2_mlx.server.batch import batchable
from dflash2_mlx.server.metrics import Metrics, parse
from dflash2_mlx.server.worker import GenerationWorker, Job

from tiny import tiny_drafter, tiny_target

PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 30], [1, 61, 62, 63, 64],
           [1, 12, 13, 14, 15, 16, 17]]
LENGTHS = [40, 12, 25, 18, 30, 22]


def _session(family, arch):
    target = tiny_target(family)
    spec = SimpleNamespace(name=f"tiny-{family}", target="/nowhere", drafter="/nowhere", defaults={}, notes=[])
    from dflash2_mlx.session import Session

    return Session(spec=spec, target=target, drafter=tiny_drafter(target, arch, block_size=4), block_size=None)


async def _drain(job):
    return [e async for e in job.events()]


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_rows_joining_and_leaving_equal_their_single_stream_output(family, arch):
    session = _session(family, arch)
    metrics = Metrics()

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=16, metrics=metrics, max_batch=4)
        worker.start()
        jobs = [Job(PROMPTS[0], SamplingParams(), LENGTHS[0], [], loop)]
        worker.submit(jobs[0])
        first = jobs[0].events()
        head = [await first.__anext__(), await first.__anext__()]  # the first job decodes alone ...
        alone = parse(metrics.render())
        assert alone["dflash2_solo_width"] == 0  # in the batch (its metrics follow each step), not solo
        # ... and the others arrive while it does
        for p, n in zip(PROMPTS[1:], LENGTHS[1:]):
            jobs.append(Job(p, SamplingParams(), n, [], loop))
        jobs.append(Job(PROMPTS[1], SamplingParams(temperature=0.8), 20, [], loop))  # sampled row
        cancelled = Job(PROMPTS[2], SamplingParams(), 200, [], loop)
        for job in jobs[1:] + [cancelled]:
            worker.submit(job)
        drains = [asyncio.ensure_future(_drain(job)) for job in jobs[1:]]
        seen, during = 0, None
        async for _ in cancelled.events():
            seen += 1
            if seen == 3:
                during = parse(metrics.render())  # the batch is running
                worker.cancel(cancelled)
        results = [head + [e async for e in first]] + [await d for d in drains]
        worker.close()
        return jobs, results, cancelled, during

    jobs, results, cancelled, during = asyncio.run(main())
    assert during["dflash2_batch_size"] >= 1 and during["dflash2_batch_width"] == 4  # the session's fixed width
    assert during['dflash2_batch_row_tokens_per_cycle{stat="max"}'] >= 1.0
    for job, events, n in zip(jobs, results, LENGTHS):
        tokens = [t for e in events for t in e.tokens]
        assert tokens == session.generate(job.prompt_ids, max_tokens=n).tokens
        assert job.stats.n_speculative > 0  # batched rows speculate too (the session's fixed width)
    sampled = [t for e in results[-1] for t in e.tokens]
    assert len(sampled) == 20 and jobs[-1].stats.finish_reason == "length"
    assert cancelled.stats.cancelled and cancelled.stats.events_after_cancel <= 1
    counts = parse(metrics.render())
    assert counts["dflash2_batch_size_max"] == 4 and counts['dflash2_jobs_total{outcome="completed"}'] == len(jobs)
    assert counts["dflash2_generated_tokens_per_second"] > 0
    assert counts["dflash2_solo_width"] == 0 and counts["dflash2_solo_tokens_per_cycle"] == 0  # none running
    assert counts["dflash2_batch_width"] == 0 and counts['dflash2_batch_row_tokens_per_cycle{stat="max"}'] == 0


def test_the_aggregate_rate_counts_the_last_ten_seconds():
    metrics = Metrics()
    metrics.tokens_posted(30, now=100.0)
    metrics.tokens_posted(50, now=104.0)
    assert metrics.aggregate_tps(now=105.0) == pytest.approx(8.0)  # 80 tokens over the 10 s window
    assert metrics.aggregate_tps(now=112.0) == pytest.approx(5.0)  # the first batch has aged out
    assert metrics.aggregate_tps(now=120.0) == 0.0


def test_only_seeded_replies_stay_out_of_the_batch():
    loop = SimpleNamespace()
    for kwargs in (dict(), dict(top_logprobs=2), dict(constraint=object())):
        assert batchable(Job([1], SamplingParams(temperature=0.5, repetition_penalty=1.2), 4, [], loop, **kwargs))
    assert not batchable(Job([1], SamplingParams(seed=1), 4, [], loop))


def test_32_concurrent_streaming_clients_three_rounds_no_errors(tmp_path):
    """A real `dflash2 serve`: 32 streaming clients at once, three rounds; every reply equals
    the one the same prompt gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from test_server_harness import ServerProcess, metrics, write_pair

    pair = write_pair(tmp_path / "pair")
    with ServerProcess(*pair, "--max-concurrency", "64", log_path=tmp_path / "server.log") as server:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)

        def ask(i: int) -> str:
            stream = oa.chat.completions.create(model="tiny-llama", max_tokens=16, stream=True,
                                                messages=[{"role": "user", "content": f"Count to {i % 7}"}])
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        alone = {k: ask(k) for k in range(7)}  # one at a time: each runs solo
        with ThreadPoolExecutor(32) as pool:
            for _ in range(3):
                replies = list(pool.map(ask, range(32)))
                assert replies == [alone[i % 7] for i in range(32)]
        counts = metrics(server.url)
        assert "Traceback" not in server.logs()
    assert counts["dflash2_batch_size_max"] == 32 and counts['dflash2_jobs_total{outcome="failed"}'] == 0
    assert counts['dflash2_jobs_total{outcome="completed"}'] == 7 + 96


def test_a_batched_row_starts_from_its_prefix_cache_entry_and_hands_it_back():
    from dflash2_mlx.server.cache_pool import PromptCachePool

    session = _session("llama", "dflash2")
    pool = PromptCachePool(session.prompt_cache)

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, prompt_caches=pool, max_batch=4)
        worker.start()
        first = Job(PROMPTS[2], SamplingParams(), 10, [], loop)
        worker.submit(first)
        reply = [t for e in await _drain(first) for t in e.tokens]
        long = Job(PROMPTS[0], SamplingParams(), 60, [], loop)  # decodes alone while the next turn arrives
        worker.submit(long)
        stream = long.events()
        await stream.__anext__()
        turn = Job(PROMPTS[2] + reply + [44, 45, 46], SamplingParams(), 12, [], loop)
        worker.submit(turn)
        events = await _drain(turn)
        _ = [e async for e in stream]
        worker.close()
        return turn, events

    turn, events = asyncio.run(main())
    tokens = [t for e in events for t in e.tokens]
    assert tokens == session.generate(turn.prompt_ids, max_tokens=12).tokens
    assert events[0].cached_tokens >= len(PROMPTS[2])
    assert pool.snapshot().hits >= 1
    # the batch handed the row's caches back: the entry now covers the turn and (all but the last of) its reply
    covered = turn.prompt_ids + tokens[:-1]
    assert any(c.tokens[: len(covered)] == covered for c in pool._entries.values())


def test_a_target_the_batch_cannot_hold_serves_one_at_a_time(monkeypatch, caplog):
    from dflash2_mlx.core import batch_cache
    from dflash2_mlx.errors import UnsupportedCacheError

    def refuse(target, *kv):
        raise UnsupportedCacheError("layer 0: a ChunkedKVCache cannot join a speculative batch")

    monkeypatch.setattr(batch_cache, "empty_batch", refuse)
    worker = GenerationWorker(_session("llama", "dflash2"), capacity=4, max_batch=8)
    assert worker.max_batch == 1
    assert "batching is off (--max-batch 1): layer 0: a ChunkedKVCache" in caplog.text


def test_a_bad_batched_request_fails_alone_with_a_400():
    from dflash2_mlx.server.worker import JobFailed

    session = _session("llama", "dflash2")

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, max_batch=4)
        worker.start()
        solo = Job(PROMPTS[0], SamplingParams(), 30, [], loop)
        worker.submit(solo)
        stream = solo.events()
        await stream.__anext__()  # decoding alone: the next ones join it
        bad, good = Job([1, 10_000], SamplingParams(), 8, [], loop), Job(PROMPTS[1], SamplingParams(), 12, [], loop)
        worker.submit(bad)
        worker.submit(good)
        with pytest.raises(JobFailed) as failed:
            await _drain(bad)
        events = await _drain(good)
        _ = [e async for e in stream]
        worker.close()
        return failed.value.failure, events

    failure, events = asyncio.run(main())
    assert failure.status == 400 and "outside the vocab" in failure.message
    assert [t for e in events for t in e.tokens] == session.generate(PROMPTS[1], max_tokens=12).tokens


def test_a_long_prompt_arriving_while_a_batch_runs_is_prefilled_between_its_steps():
    session = _session("llama", "dflash2")
    long_prompt = [1] + [(5 * j) % 90 + 3 for j in range(1500)]

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, max_batch=4, prefill_chunk=64)
        worker.start()
        a, b = Job(PROMPTS[0], SamplingParams(), 60, [], loop), Job(PROMPTS[1], SamplingParams(), 60, [], loop)
        worker.submit(a)
        stream_a = a.events()
        await stream_a.__anext__()
        worker.submit(b)
        stream_b = b.events()
        await stream_b.__anext__()  # a batch runs now (b joined; a moved in)
        order = []

        async def follow(name, stream):
            async for _ in stream:
                order.append(name)

        c = Job(long_prompt, SamplingParams(), 4, [], loop)
        worker.submit(c)
        await asyncio.gather(follow("a", stream_a), follow("b", stream_b), follow("c", c.events()))
        worker.close()
        return order, c

    order, c = asyncio.run(main())
    first_c = order.index("c")
    # the 1,500-token prompt took ~24 chunks: the running rows kept getting tokens meanwhile
    assert order[:first_c].count("a") >= 15 and order[:first_c].count("b") >= 15, order[:first_c + 1]
    assert c.stats.finish_reason == "length"


def test_a_failing_row_fails_alone_with_its_own_error():
    from test_batch_engine import FailingConstraint

    from dflash2_mlx.server.worker import JobFailed

    session = _session("llama", "dflash2")

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, max_batch=4)
        worker.start()
        first = Job(PROMPTS[0], SamplingParams(), 40, [], loop)
        worker.submit(first)
        stream = first.events()
        head = [await stream.__anext__()]
        bad = Job(PROMPTS[1], SamplingParams(), 40, [], loop, constraint=FailingConstraint(3))
        good = Job(PROMPTS[2], SamplingParams(), 25, [], loop)
        worker.submit(bad), worker.submit(good)
        rest = asyncio.ensure_future(_drain(good))
        with pytest.raises(JobFailed) as failed:
            await _drain(bad)
        events = head + [e async for e in stream]
        good_events = await rest
        worker.close()
        return failed.value.failure, events, good_events

    failure, events, good_events = asyncio.run(main())
    assert (failure.status, failure.message) == (400, "grammar broke at cycle 3")
    assert [t for e in events for t in e.tokens] == session.generate(PROMPTS[0], max_tokens=40).tokens
    assert [t for e in good_events for t in e.tokens] == session.generate(PROMPTS[2], max_tokens=25).tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_second_request_arriving_after_a_pipelined_plain_step_leaves_both_exact(family):
    """A plain step queues the next one ahead; a second request arriving then makes the first
    row's caches ragged only once nothing is queued (a recurrent layer cannot take a token back):
    both replies equal their single streams on every cache kind."""
    from dflash2_mlx.session import Session

    target = tiny_target(family)
    spec = SimpleNamespace(name=f"tiny-{family}", target="/nowhere", drafter="none", defaults={}, notes=[])
    session = Session(spec=spec, target=target, drafter=None, block_size=None)

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, max_batch=4)
        worker.start()
        first = Job(PROMPTS[0], SamplingParams(), 40, [], loop)
        worker.submit(first)
        stream = first.events()
        head = [await stream.__anext__() for _ in range(4)]  # plain steps, each queuing the next
        second = Job(PROMPTS[1], SamplingParams(), 12, [], loop)
        worker.submit(second)
        rest = [e async for e in stream]
        other = await _drain(second)
        worker.close()
        return head + rest, other, second

    events, other, second = asyncio.run(main())
    assert [t for e in events for t in e.tokens] == session.generate(PROMPTS[0], max_tokens=40).tokens
    assert [t for e in other for t in e.tokens] == session.generate(second.prompt_ids, max_tokens=12).tokens
