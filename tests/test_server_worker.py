"""The server's library parts in-process: worker queue and cancellation, stats, metrics, names.

A real `Session` over the tiny in-memory pair; the worker runs on its own thread as in the
server, and an asyncio loop in the test receives its events.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dflash2_mlx.core.sampling import SamplingParams
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.server.config import ServerConfig
from dflash2_mlx.server.dispatch import check_model, make_state
from dflash2_mlx.server.errors import APIError, validation_message
from dflash2_mlx.server.metrics import Metrics, parse
from dflash2_mlx.server.worker import Failed, GenerationWorker, Job, JobFailed, JobStats, QueueFull, ServerClosing
from dflash2_mlx.session import Session

from tiny import tiny_drafter, tiny_target

PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def session():
    target = tiny_target("llama")
    spec = SimpleNamespace(name="tiny-llama", target="/nowhere/tiny-llama", drafter="/nowhere/drafter",
                           defaults={}, notes=[])
    return Session(spec=spec, target=target, drafter=tiny_drafter(target, block_size=4), block_size=None)


def _job(loop, max_tokens=8, prompt=PROMPT):
    return Job(list(prompt), SamplingParams(), max_tokens, [], loop)


async def _drain(job: Job) -> list:
    return [event async for event in job.events()]


def test_fifo_order_capacity_and_stats(session):
    async def main():
        loop = asyncio.get_running_loop()
        metrics = Metrics()
        worker = GenerationWorker(session, capacity=3, metrics=metrics)
        jobs = [_job(loop, max_tokens=4 + i) for i in range(3)]
        for job in jobs:
            worker.submit(job)
        with pytest.raises(QueueFull):
            worker.submit(_job(loop))
        worker.start()
        results = [await _drain(job) for job in jobs]
        worker.close()
        return jobs, results, metrics

    jobs, results, metrics = asyncio.run(main())
    # FIFO: each job waited for all the ones before it
    waits = [job.stats.queued_ms for job in jobs]
    assert waits == sorted(waits)
    reference = session.generate(PROMPT, max_tokens=6)
    events = results[2]
    assert [t for e in events for t in e.tokens] == reference.tokens
    stats = jobs[2].stats
    assert stats.predicted_n == len(reference.tokens) and stats.finish_reason == "length"
    assert stats.n_cycles == len(reference.cycles)
    assert stats.draft_n == sum(c.n_drafted for c in reference.cycles)
    assert stats.draft_n_accepted == sum(c.n_accepted for c in reference.cycles)
    assert stats.tokens_per_cycle == pytest.approx(reference.tau)
    timings = stats.timings()
    assert timings["predicted_n"] == 6 and timings["prompt_n"] == len(PROMPT) and timings["draft_n"] > 0
    assert parse(metrics.render())['dflash2_jobs_total{outcome="completed"}'] == 3


def test_cancel_running_job_stops_within_one_cycle(session):
    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=2)
        job = _job(loop, max_tokens=400)
        worker.submit(job)
        worker.start()
        seen = 0
        async for _ in job.events():
            seen += 1
            if seen == 3:
                worker.cancel(job)
        worker.close()
        return job

    job = asyncio.run(main())
    assert job.stats.cancelled and job.stats.finish_reason is None
    assert job.stats.events_after_cancel <= 1
    assert job.stats.predicted_n < 400


def test_cancelled_waiting_job_never_runs(session):
    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=3)
        first, second, third = _job(loop, max_tokens=400), _job(loop), _job(loop, max_tokens=3)
        for job in (first, second, third):
            worker.submit(job)
        worker.start()
        await first.items.get()  # the first job is generating; the others wait
        worker.cancel(second)
        worker.cancel(first)
        events = await _drain(third)
        with pytest.raises(JobFailed) as info:
            await _drain(second)
        worker.close()
        return second, info.value.failure, events

    second, failure, events = asyncio.run(main())
    assert failure.status == 499 and second.stats.n_events == 0
    assert sum(len(e.tokens) for e in events) == 3


def test_close_refuses_waiting_and_new_jobs(session):
    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=3)
        waiting = _job(loop)
        worker.submit(waiting)
        worker.close()
        with pytest.raises(ServerClosing):
            worker.submit(_job(loop))
        with pytest.raises(JobFailed) as info:
            await _drain(waiting)
        return info.value.failure

    assert asyncio.run(main()) == Failed(503, "server is shutting down", "server_error")


def test_engine_errors_become_failures_and_the_worker_survives(session):
    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=2)
        worker.start()
        bad = _job(loop, prompt=[5, 5000])  # outside the vocab: the engine's ConfigError
        worker.submit(bad)
        with pytest.raises(JobFailed) as info:
            await _drain(bad)
        good = _job(loop, max_tokens=3)
        worker.submit(good)
        events = await _drain(good)
        worker.close()
        return info.value.failure, events

    failure, events = asyncio.run(main())
    assert failure.status == 400 and "5000" in failure.message
    assert sum(len(e.tokens) for e in events) == 3


@pytest.mark.parametrize("prompt_ms, shift_ms", [(40.0, 10.0), (12.0, 6.0)])
def test_ollama_durations_move_the_first_token_at_the_mean_step_or_half_the_prompt_pass(prompt_ms, shift_ms):
    """A 10 ms mean step: a 40 ms prompt pass gives up one step, a 12 ms one (a cached prefix) only
    half of itself; either way the two durations sum to the time spent."""
    stats = JobStats(prompt_n=20, prompt_ms=prompt_ms, predicted_n=5, predicted_ms=40.0)
    prompt_eval_ms, eval_ms = stats.ollama_durations_ms()
    assert (prompt_eval_ms, eval_ms) == pytest.approx((prompt_ms - shift_ms, 40.0 + shift_ms))
    alone = JobStats(prompt_n=9, cached_tokens=4, prompt_ms=30.0, predicted_n=1)
    assert alone.ollama_durations_ms() == pytest.approx((25.0, 5.0))  # the token's share of 5 uncached + 1


def test_model_names(session):
    state = make_state(session, ServerConfig())
    assert state.model_name == "tiny-llama"
    for name in (None, "", "tiny-llama", "TINY-LLAMA", "tiny-llama:latest"):
        assert check_model(state, name) == "tiny-llama"
    for name, status in (("/etc/passwd", 400), ("../tiny-llama", 400), ("C:\\models", 400), ("a.gguf", 400),
                         ("~/models/x", 400), ("gpt-4o", 404), ("org/other-model", 404)):
        with pytest.raises(APIError) as info:
            check_model(state, name)
        assert info.value.status == status and repr(name) in info.value.message


def test_config_bounds():
    for kwargs in ({"port": 70000}, {"max_concurrency": 0}, {"max_tokens_cap": 0}, {"api_key": " "},
                   {"max_prompt_tokens": 0}, {"default_temperature": -1.0}):
        with pytest.raises(ConfigError):
            ServerConfig(**kwargs)
    assert ServerConfig(max_tokens_cap=100).max_tokens_default == 100


def test_metrics_text_format():
    metrics = Metrics({"model": 'we"ird\nname'})
    metrics.response("/v1/completions", 200)
    metrics.response("/random/probe", 404)
    text = metrics.render()
    assert 'dflash2_info{model="we\\"ird\\nname"} 1' in text
    values = parse(text)
    assert values['dflash2_requests_total{route="/v1/completions",status="200"}'] == 1
    assert values['dflash2_requests_total{route="other",status="404"}'] == 1
    assert values["dflash2_tokens_per_cycle"] == 1
    assert metrics.retry_after(5) == 5  # no jobs measured yet: one second each


def test_validation_messages_name_field_and_value():
    message, param = validation_message([{"type": "greater_than_equal", "loc": ("body", "max_tokens"),
                                           "msg": "Input should be greater than or equal to 1", "input": -5}])
    assert message == "max_tokens: Input should be greater than or equal to 1 (got -5)" and param == "max_tokens"
    message, _ = validation_message([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                                      "input": {}, "ctx": {"error": "Expecting value"}}])
    assert message == "malformed JSON body: Expecting value"
