"""The batch bounded by memory: K/V bytes per token measured on the pair, and admission that
keeps the context every running request may reach within the budget (one alone always runs)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dflash2_mlx.core.generate import stream_generate
from dflash2_mlx.core.sampling import SamplingParams
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.server import capacity
from dflash2_mlx.server.capacity import KVBudget, KVCost
from dflash2_mlx.server.worker import GenerationWorker, Job

from tiny import tiny_drafter, tiny_target


def _session(family="llama"):
    target = tiny_target(family)
    spec = SimpleNamespace(name=f"tiny-{family}", target="/nowhere", drafter="/nowhere", defaults={}, notes=[])
    from dflash2_mlx.session import Session

    return Session(spec=spec, target=target, drafter=tiny_drafter(target, "dflash2", block_size=4), block_size=None)


def test_budget_admits_one_alone_and_bounds_the_rest():
    budget = KVBudget(1000, KVCost(per_token=2.0, per_row=100.0))
    assert budget.fits(10_000)  # nothing held: a request alone always runs
    budget.hold(1, 200)  # 500 bytes
    assert budget.fits(200) and not budget.fits(201)
    budget.hold(2, 200)
    assert budget.held_bytes == 1000 and not budget.fits(0)
    budget.release(1)
    assert budget.fits(200)
    with pytest.raises(ConfigError, match="--batch-memory must be > 0 bytes, got 0"):
        KVBudget(0, KVCost(1.0, 0.0))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_measured_cost_predicts_a_prompt_caches_bytes(family):
    session = _session(family)
    cost = capacity.measure_kv_cost(session)
    assert cost.per_token > 0
    if family == "qwen3_5":  # recurrent layers: a state per row whatever its length
        assert cost.per_row > 0
    n = 320 + 256  # a whole KV step past the probe: what a longer row holds
    cache = session.prompt_cache()
    for _ in stream_generate(session.target, [1 + i % 90 for i in range(n)], drafter=session.drafter, max_tokens=1,
                             prompt_cache=cache):
        pass
    assert cache.nbytes == pytest.approx(cost.row_bytes(n), rel=0.05)


def test_auto_budget_leaves_out_weights_and_the_prefix_cache():
    session = _session()
    weights = capacity.weights_bytes(session.target.model, session.drafter)
    assert capacity.auto_budget(session, 1 << 20, memory=1 << 30) == (1 << 29) - weights - (1 << 20)
    with pytest.raises(ConfigError, match="no memory left for decoding: 50% of 1.0 GiB"):
        capacity.auto_budget(session, 1 << 29, memory=1 << 30)


class RecordingBudget(KVBudget):
    """A KVBudget that remembers the most requests it ever held at once."""

    most = 0

    def hold(self, key, n_tokens):
        super().hold(key, n_tokens)
        self.most = max(self.most, len(self.held))


def test_jobs_beyond_the_budget_wait_their_turn_and_decode_exactly():
    session = _session()
    cost = capacity.measure_kv_cost(session)
    prompts = [[1, 40 + i, 41, 42, 43] for i in range(5)]
    n_tokens = 24
    budget = RecordingBudget(int(2.5 * cost.row_bytes(len(prompts[0]) + n_tokens)), cost)  # two at a time

    async def main():
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(session, capacity=8, max_batch=4, kv_budget=budget)
        worker.start()
        jobs = [Job(p, SamplingParams(), n_tokens, [], loop) for p in prompts]
        for job in jobs:
            worker.submit(job)
        results = [[e async for e in job.events()] for job in jobs]
        worker.close()
        return jobs, results

    jobs, results = asyncio.run(main())
    for job, events in zip(jobs, results):
        assert [t for e in events for t in e.tokens] == session.generate(job.prompt_ids, max_tokens=n_tokens).tokens
    assert budget.most == 2 and budget.held == {}
    assert jobs[4].stats.started_at > jobs[1].stats.started_at  # it waited for room
