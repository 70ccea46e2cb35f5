"""Requests that arrive while others run decode together, speculatively, in one batch.

The worker gives the first request in flight the single-stream engine; requests that arrive
while it runs join a `BatchRun`, a `SpeculativeBatch` (`batch_engine.py`): per-row drafts,
one batched verify, per-row acceptance and rollback, rows joining and leaving between
cycles and prompts prefilled a chunk per step. Each cycle's width comes from the session's
block size: fixed, or with `--block-size auto` a `BatchWidthPolicy` that picks it for the
current batch size from this machine's measured costs (plain batched decoding when
speculation does not pay at that concurrency). Once a batch exists, the solo reply moves
into it (`adopt`), drafter context and caches included, whatever the target's cache kinds.

Rows get the engine's events, so the API layers cannot tell a batched reply from a
single-stream one; a row's prompt cache (from the pool) gets its caches back when it ends.
A row is batchable unless it is seeded: a seeded reply must give the same tokens whether it
arrives alone or beside others, and the batch's widths follow the load.
"""

from __future__ import annotations

import dataclasses

from ..core.batch_engine import SpeculativeBatch


def batchable(job) -> bool:
    """Whether `job` can decode in the batch (see the module docstring)."""
    return job.sampling.seed is None


def can_adopt(cache) -> bool:
    """Whether a single-stream reply can move into the batch: its caches must outlive the
    engine's run (a `PromptCache`; any cache kind the engine rolls back will do)."""
    return cache is not None


def batch_policy(session):
    """The batch's width policy for a session: None (its fixed width) unless `--block-size auto`."""
    if session.drafter is None or session.block_size != "auto":
        return None
    from ..core.block_policy import BatchWidthPolicy

    session.prepare()  # the calibration, measured once per machine
    # The drafts' acceptance is the drafter's on this traffic, whether a row runs alone or batched.
    return BatchWidthPolicy(session.policy.costs, acceptance=session.policy.acceptance)


class BatchRun:
    """The running batch: `add` a job, `step` once per worker turn, `remove` a cancelled one."""

    def __init__(self, session, max_batch: int, prefill_chunk: int, policy=None):
        width = session.block_size if isinstance(session.block_size, int) else None
        self.engine = SpeculativeBatch(session.target, session.drafter, block_size=width, policy=policy,
                                       prefill_step_size=prefill_chunk)
        self.max_batch = max_batch
        self.jobs: dict[int, object] = {}  # row id -> job
        self.caches: dict[int, object] = {}  # row id -> its PromptCache (from the pool), if any
        self._cached: dict[int, int] = {}  # row id -> cached tokens to report (a reply that moved in)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def full(self) -> bool:
        return len(self.jobs) >= self.max_batch

    @property
    def width(self) -> int:
        """The last cycle's verify width (1: plain batched decoding; 0: none ran yet)."""
        return self.engine.last_width

    def add(self, job, cache=None) -> None:
        """Start `job` in the batch; `cache` (a `PromptCache` checked out of the pool, or None)
        supplies the prefix of the prompt it reaches exactly and gets the caches back."""
        rid = self.engine.add(job.prompt_ids, job.max_tokens, sampling=job.sampling, stop=job.stop,
                              top_logprobs=job.top_logprobs, constraint=job.constraint, prompt_cache=cache)
        self.jobs[rid], self.caches[rid] = job, cache

    def adopt(self, job, cache, emitted: list[int], sent: int) -> None:
        """Continue a reply the single-stream engine started: `cache` covers a prefix of prompt +
        `emitted`; `sent` characters of the text went out already."""
        rid = self.engine.add(job.prompt_ids, job.max_tokens, sampling=job.sampling, stop=job.stop,
                              top_logprobs=job.top_logprobs, constraint=job.constraint, prompt_cache=cache,
                              reply=emitted, sent=sent)
        self.jobs[rid], self.caches[rid], self._cached[rid] = job, cache, job.stats.cached_tokens

    def remove(self, job):
        """Drop a cancelled job; returns its prompt cache (covering its prompt and reply so far)."""
        for rid, j in list(self.jobs.items()):
            if j is job:
                self.engine.remove(rid)
                del self.jobs[rid]
                self._cached.pop(rid, None)
                return self.caches.pop(rid)
        return None

    def step(self) -> list[tuple[object, object, object]]:
        """One batch step: (job, event, cache) for each row that produced tokens; `cache` is
        the row's prompt cache, handed back, when the event ends the row (else None)."""
        out = []
        for rid, event in self.engine.step():
            job = self.jobs[rid]
            if rid in self._cached:
                event = dataclasses.replace(event, cached_tokens=self._cached[rid])
            cache = None
            if event.finish_reason is not None:
                del self.jobs[rid]
                self._cached.pop(rid, None)
                cache = self.caches.pop(rid)
            out.append((job, event, cache))
        return out

    def take_failures(self) -> list[tuple[object, Exception, object]]:
        """(job, error, its reset prompt cache) for each row that failed alone in the last step."""
        failed = []
        for rid, error in self.engine.take_failures():
            self._cached.pop(rid, None)
            failed.append((self.jobs.pop(rid), error, self.caches.pop(rid)))
        return failed

    def rows_tau(self) -> list[float]:
        """Each running row's tokens per speculative cycle so far."""
        return [j.stats.tokens_per_cycle for j in self.jobs.values()]
