"""Requests decode together, speculatively, in one batch.

A `BatchRun` wraps a `SpeculativeBatch` (`batch_engine.py`): a row alone decodes on its own
caches exactly as a single stream; with others, per-row drafts, one batched verify, per-row
acceptance and rollback, rows joining and leaving between cycles and prompts prefilled a
chunk per step. Each cycle's width comes from the session's block size: fixed, or with
`--block-size auto` a `BatchWidthPolicy` that picks it for the current batch size from this
machine's measured costs (plain batched decoding when speculation does not pay at that
concurrency).

Rows get the engine's events, so the API layers cannot tell a batched reply from a
single-stream one; a row's prompt cache (from the pool) gets its caches back when it ends.
A row is batchable unless it is seeded: a seeded reply must give the same tokens whether it
arrives alone or beside others, and the batch's widths follow the load.
"""

from __future__ import annotations

from ..core.batch_engine import SpeculativeBatch
from ..core.generate import single_row


def batchable(job) -> bool:
    """Whether `job` can decode in the batch (see the module docstring)."""
    return job.sampling.seed is None


def batch_policy(session):
    """The batch's width policy for a session: None (its fixed width) unless `--block-size auto`."""
    if not session.adaptive:
        return None
    from ..core.block_policy import BatchWidthPolicy

    session.prepare()  # the calibration, measured once per machine
    # The drafts' acceptance is the drafter's on this traffic, whether a row runs alone or batched.
    return BatchWidthPolicy(session.policy.costs, acceptance=session.policy.acceptance)


class BatchRun:
    """Jobs on one decoder: `add` a job, `step` once per worker turn, `remove` a cancelled one.
    `shared` makes the batch the batchable jobs join; `solo` a decoder of one job that decodes
    on its own (seeded, a sharded target, or `--max-batch 1`); both hold the session's K/V
    quantization."""

    def __init__(self, engine: SpeculativeBatch):
        self.engine = engine
        self.jobs: dict[int, object] = {}  # row id -> job
        self.caches: dict[int, object] = {}  # row id -> its PromptCache (from the pool), if any

    @classmethod
    def shared(cls, session, prefill_chunk: int, policy=None) -> BatchRun:
        return cls(SpeculativeBatch(session.target, session.drafter, block_size=session.width, policy=policy,
                                    prefill_step_size=prefill_chunk, kv_bits=session.kv_bits,
                                    kv_group_size=session.kv_group_size))

    @classmethod
    def solo(cls, session, job, prefill_chunk: int, cache=None) -> BatchRun:
        """`job` alone on its decoder, at the width (and policy) `session.speculation` gives its
        sampling, with the session's K/V quantization and sharding."""
        width, policy = session.speculation(job.sampling)
        engine, rid = single_row(session.target, job.prompt_ids, job.max_tokens, drafter=session.drafter,
                                 sampling=job.sampling, prompt_cache=cache, block_size=width, stop=job.stop,
                                 prefill_step_size=prefill_chunk, block_policy=policy, kv_bits=session.kv_bits,
                                 kv_group_size=session.kv_group_size, top_logprobs=job.top_logprobs,
                                 constraint=job.constraint, lockstep=session.lockstep)
        run = cls(engine)
        run.jobs[rid], run.caches[rid] = job, cache
        return run

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def last_width(self) -> int:
        """The last cycle's verify width (1: plain batched decoding; 0: none ran yet)."""
        return self.engine.last_width

    def add(self, job, cache=None) -> None:
        """Start `job` in the batch; `cache` (a `PromptCache` checked out of the pool, or None)
        supplies the prefix of the prompt it reaches exactly and gets the caches back."""
        rid = self.engine.add(job.prompt_ids, job.max_tokens, sampling=job.sampling, stop=job.stop,
                              top_logprobs=job.top_logprobs, constraint=job.constraint, prompt_cache=cache)
        self.jobs[rid], self.caches[rid] = job, cache

    def remove(self, job):
        """Drop a cancelled job; returns its prompt cache (covering its prompt and reply so far)."""
        for rid, j in list(self.jobs.items()):
            if j is job:
                self.engine.remove(rid)
                del self.jobs[rid]
                return self.caches.pop(rid)
        return None

    def step(self) -> list[tuple[object, object, object]]:
        """One batch step: (job, event, cache) for each row that produced tokens; `cache` is
        the row's prompt cache, handed back, when the event ends the row (else None)."""
        out = []
        for rid, event in self.engine.step():
            job = self.jobs[rid]
            cache = None
            if event.finish_reason is not None:
                del self.jobs[rid]
                cache = self.caches.pop(rid)
            out.append((job, event, cache))
        return out

    def take_failures(self) -> list[tuple[object, Exception, object]]:
        """(job, error, its reset prompt cache) for each row that failed alone in the last step."""
        failed = []
        for rid, error in self.engine.take_failures():
            failed.append((self.jobs.pop(rid), error, self.caches.pop(rid)))
        return failed

    def prefilling(self) -> tuple[int, int]:
        """(prompt tokens prefilled, prompt tokens) of the row whose prompt goes next; (0, 0)
        when none is joining."""
        joining = self.engine.joining
        return (joining[0].run.fed, len(joining[0].ids)) if joining else (0, 0)

    def rows_tau(self) -> list[float]:
        """Each running row's tokens per speculative cycle so far."""
        return [j.stats.tokens_per_cycle for j in self.jobs.values()]
