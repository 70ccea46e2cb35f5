"""The one generation worker: a thread that owns all MLX work, fed by a bounded FIFO queue.

Requests become `Job`s (token ids + sampling + limits). `GenerationWorker.submit` admits a
job only while fewer than `capacity` jobs are waiting or running, else raises `QueueFull`
(the app answers 429 with Retry-After). The thread takes jobs in arrival order. A job the
batch can take (not seeded) joins the speculative *batch* (`batch.py`, at most `max_batch`
rows and, with a `kv_budget`, only while its context fits): alone there it decodes on its
native caches exactly as a single stream, with others the rows share one batched verify. A
seeded job runs *solo* on the single-stream engine (its draws must not depend on neighbours),
alternating one cycle with one batch step. No reply ever moves between the two. Each engine
event is posted to its job's asyncio queue on the event loop. A cancelled job stops at the next
cycle or step: the worker checks the flag after every event, so at most one cycle runs after
`cancel`; prompts are prefilled `prefill_chunk` tokens per step, the flag checked in between.
A job cut by shutdown ends with a 503 failure, so its client sees an error rather than a
truncated reply.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..core.interfaces import Constraint
from ..core.stats import tau_from_counts
from ..errors import DFlashError

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue is full; `depth` jobs are waiting or running."""

    def __init__(self, depth: int, capacity: int):
        super().__init__(f"server busy: {depth} requests in flight (--max-concurrency {capacity})")
        self.depth, self.capacity = depth, capacity


class ServerClosing(Exception):
    """The server is shutting down and admits no new work."""

    def __init__(self):
        super().__init__("server is shutting down")


@dataclass
class JobStats:
    """What one job measured, in llama.cpp server's `timings` vocabulary.

    Times are wall clock on the worker, as llama-server books them: `prompt_ms` runs from the
    job's start to its first token (the prompt pass yields that token's logits), `predicted_ms`
    from the first token to the last. `predicted_n` counts every token, the first included,
    so the rates divide by the `predicted_n - 1` tokens that `predicted_ms` actually timed.
    """

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    n_cycles: int = 0
    n_speculative: int = 0
    n_events: int = 0
    queued_ms: float = 0.0
    finish_reason: str | None = None
    cancelled: bool = False
    events_after_cancel: int = 0
    started_at: float | None = None
    first_token_at: float | None = None
    stop_sequence: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied

    def observe(self, event, now: float | None = None) -> None:
        """Fold one `GenerationEvent`, seen at `now` (perf_counter), into the totals."""
        now = time.perf_counter() if now is None else now
        self.n_events += 1
        self.prompt_n = event.prompt_tokens
        self.cached_tokens = event.cached_tokens
        if self.first_token_at is None:
            self.first_token_at = now
            self.prompt_ms = 1e3 * (now - (self.started_at if self.started_at is not None else now))
        self.predicted_n = event.generation_tokens
        self.predicted_ms = 1e3 * (now - self.first_token_at)
        self.finish_reason = event.finish_reason
        self.stop_sequence = event.stop_sequence
        cycle = event.cycle
        if cycle is not None:
            self.n_cycles += 1
            if cycle.n_drafted > 0:
                self.n_speculative += 1
                self.draft_n += cycle.n_drafted
                self.draft_n_accepted += cycle.n_accepted

    @property
    def predicted_per_second(self) -> float:
        """Decode rate over the tokens after the first (0.0 when fewer than two)."""
        timed = self.predicted_n - 1
        return 1e3 * timed / self.predicted_ms if timed > 0 and self.predicted_ms > 0 else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """τ: mean tokens per speculative cycle, bonus included (1.0 without speculation)."""
        return tau_from_counts(self.draft_n_accepted, self.n_speculative)

    def ollama_durations_ms(self) -> tuple[float, float]:
        """Ollama's (prompt_eval_duration, eval_duration), summing to the time actually spent, so
        that eval_count / eval_duration is the decode rate: the first token is moved out of the
        prompt pass at the mean decode cost, but at most half of that pass (a prompt the prefix
        cache supplied can take less than a decode step, and still took time). A lone token has
        no decode step to measure: it gets its position's share of the prompt pass."""
        if self.predicted_n <= 1:
            if not self.predicted_n:
                return self.prompt_ms, 0.0
            share = self.prompt_ms / (max(self.prompt_n - self.cached_tokens, 0) + 1)
            return self.prompt_ms - share, share
        shift = min(self.predicted_ms / (self.predicted_n - 1), self.prompt_ms / 2)
        return self.prompt_ms - shift, self.predicted_ms + shift

    def timings(self) -> dict:
        """llama.cpp server's `timings` object plus `tokens_per_cycle`."""
        timed = self.predicted_n - 1
        return {
            "prompt_n": self.prompt_n,
            "cache_n": self.cached_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_token_ms": round(self.prompt_ms / self.prompt_n, 3) if self.prompt_n else 0.0,
            "prompt_per_second": round(1e3 * self.prompt_n / self.prompt_ms, 3) if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_token_ms": round(self.predicted_ms / timed, 3) if timed > 0 else 0.0,
            "predicted_per_second": round(self.predicted_per_second, 3),
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "tokens_per_cycle": round(self.tokens_per_cycle, 4),
        }


@dataclass
class Finished:
    stats: JobStats


@dataclass
class Failed:
    """A job that could not run; `status` is the HTTP status the client should see."""

    status: int
    message: str
    kind: str = "invalid_request_error"


IDLE = None  # what `Job.events(idle=...)` yields when nothing happened for `idle` seconds


@dataclass
class Job:
    """One request's generation: inputs, a cancel flag and the queue its events arrive on."""

    prompt_ids: list[int]
    sampling: object
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str = ""
    top_logprobs: int | None = None  # log-probabilities asked for (alternatives per token), or None
    constraint: Constraint | None = None  # a grammar, a thinking budget (or both), or None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    stats: JobStats = field(default_factory=JobStats)
    logprobs: list = field(default_factory=list)  # filled by a non-streaming collect
    submitted_at: float = field(default_factory=time.perf_counter)
    events_at_cancel: int | None = None

    def post(self, item) -> None:
        """Hand an event (or Finished/Failed) to the request's coroutine, from any thread."""
        if isinstance(item, (Finished, Failed)):
            self.done.set()
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def events(self, idle: float | None = None):
        """Yield `GenerationEvent`s until the job ends; raise `JobFailed` if it fails. With `idle`
        (seconds), yield `IDLE` each time that long passes without an event, for a stream's keep-alive."""
        getter = None  # one pending get kept across idle spells: cancelling a finished get loses its item
        try:
            while True:
                if idle is None:
                    item = await self.items.get()
                else:
                    getter = getter or asyncio.ensure_future(self.items.get())
                    done, _ = await asyncio.wait({getter}, timeout=idle)
                    if not done:
                        yield IDLE
                        continue
                    item, getter = getter.result(), None
                if isinstance(item, Finished):
                    return
                if isinstance(item, Failed):
                    raise JobFailed(item)
                yield item
        finally:
            if getter is not None:
                getter.cancel()


class JobFailed(Exception):
    def __init__(self, failure: Failed):
        super().__init__(failure.message)
        self.failure = failure


class GenerationWorker:
    """One thread, one job at a time, FIFO; `capacity` bounds waiting + running jobs.

    Args:
        session: an open `Session`; only this thread calls into it.
        capacity: most jobs admitted at once (running included).
        metrics: a `Metrics` told about each job's start and end (optional).
        prompt_caches: a `PromptCachePool` (the prefix cache), or None for cold prompts.
        max_batch: most jobs decoding together in the batch (1: one job at a time).
        kv_budget: a `capacity.KVBudget`: a job is admitted only while the context every admitted
            job may reach fits it (None: rows alone bound the batch).
    """

    def __init__(self, session, capacity: int, metrics=None, prefill_chunk: int = 512, prompt_caches=None,
                 max_batch: int = 1, kv_budget=None):
        self.session = session
        self.kv_budget = kv_budget
        self.prompt_caches = prompt_caches
        self.max_batch = max_batch
        self.capacity = capacity
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._batch_policy = None  # the batch's width policy (`--block-size auto`), made with the first batch
        if max_batch > 1 and not self._target_batches():
            self.max_batch = 1
        self._accepting = True
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="dflash2-generation", daemon=True)

    def _target_batches(self) -> bool:
        """Whether the batch can hold this target's caches; if not, say so once and serve
        one request at a time."""
        from ..core.batch_cache import empty_batch
        from ..errors import UnsupportedCacheError

        try:
            empty_batch(self.session.target, self.session.kv_bits, self.session.kv_group_size)
        except UnsupportedCacheError as e:
            log.warning("batching is off (--max-batch 1): %s", e)
            return False
        return True

    # -- admission ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job waits or runs, at most `timeout` seconds; whether it got idle."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def submit(self, job: Job) -> None:
        """Queue `job`; raise `QueueFull` or `ServerClosing` instead of waiting."""
        with self._cond:
            if not self._accepting:
                raise ServerClosing()
            in_flight = len(self._waiting) + len(self._running)
            if in_flight >= self.capacity:
                raise QueueFull(in_flight, self.capacity)
            self._waiting.append(job)
            self._cond.notify()
        if self.metrics is not None:
            self.metrics.queue_depth(self.depth)

    def cancel(self, job: Job) -> None:
        """Stop `job`: drop it if still waiting, else stop it after the current cycle."""
        if job.done.is_set() or job.cancelled.is_set():
            return
        with self._cond:
            job.events_at_cancel = job.stats.n_events
            job.cancelled.set()
            waiting = job in self._waiting
            if waiting:
                self._waiting.remove(job)
        if waiting:
            job.stats.cancelled = True
            if self.metrics is not None:
                self.metrics.job_ended(job)
                self.metrics.queue_depth(self.depth)
            job.post(Failed(499, "cancelled before it started"))

    def stop_accepting(self) -> None:
        """New submissions get `ServerClosing`; queued and running jobs carry on."""
        with self._cond:
            self._accepting = False

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new jobs, fail the waiting ones (503), cancel the running ones, join."""
        with self._cond:
            self._accepting = False
            self._stopped = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = list(self._running)
            self._cond.notify_all()
        for job in waiting:
            job.post(Failed(503, "server is shutting down", "server_error"))
        for job in running:
            self.cancel(job)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------

    def _admit(self, solo_busy: bool, n_batch: int) -> tuple[Job | None, list[Job]]:
        """(a job to run solo, jobs to add to the batch), taken in arrival order; blocks while
        there is nothing to do."""
        from .batch import batchable

        solo, joining = None, []
        with self._cond:
            while not self._waiting and not self._running and not self._stopped:
                self._cond.wait()
            while self._waiting and not self._stopped:
                job = self._waiting[0]
                reach = len(job.prompt_ids) + job.max_tokens
                if self.kv_budget is not None and not self.kv_budget.fits(reach):
                    break  # its K/V would not fit beside the running jobs': it waits for one to end
                if self.max_batch > 1 and batchable(job):
                    if n_batch + len(joining) >= self.max_batch:
                        break  # the head waits, and everything behind it: arrival order is kept
                    joining.append(job)
                elif not solo_busy and solo is None:
                    solo = job
                else:
                    break
                self._running.append(self._waiting.popleft())
                if self.kv_budget is not None:
                    self.kv_budget.hold(id(job), reach)
        return solo, joining

    def _loop(self) -> None:
        solo, batch = None, None
        while True:
            new_solo, joining = self._admit(solo is not None, len(batch or ()))
            if new_solo is not None:
                solo = self._solo(new_solo)
            if joining:
                batch = batch or self._new_batch()
                for job in joining:
                    self._start(job)
                    self._add_to_batch(batch, job)
            if solo:
                self._step_batch(solo, solo=True)
            if solo is not None and not solo:
                solo = None
                if self.metrics is not None:
                    self.metrics.solo_cycle(0, 0.0)
            if batch:
                self._step_batch(batch)
            if batch is not None and not batch:
                batch = None  # drained: the next one starts fresh (and the memory goes back)
            if self.metrics is not None:
                self.metrics.queue_depth(self.depth)
                self.metrics.batch_size(len(batch or ()))
            if self._stopped and solo is None and not batch:
                if self.session.lockstep is not None:  # the other ranks of a sharded target leave too
                    from ..core.distributed import announce_stop

                    announce_stop(self.session.lockstep)
                return

    def _add_to_batch(self, batch, job: Job) -> None:
        """A joining job checks out its best prefix-cache entry, as a solo one does; the batch
        hands the caches back when the row ends."""
        cache = self.prompt_caches.checkout(job.prompt_ids) if self.prompt_caches is not None else None
        try:
            batch.add(job, cache)
        except DFlashError as e:  # a bad request fails alone, as it would solo
            if self.prompt_caches is not None:
                self.prompt_caches.checkin(cache)  # checked before it was touched
            job.post(Failed(400, str(e)))
            self._end(job)

    def _new_batch(self):
        from .batch import BatchRun, batch_policy

        if self._batch_policy is None:  # one for the worker: it keeps learning across batches
            self._batch_policy = batch_policy(self.session)
        return BatchRun.shared(self.session, self.prefill_chunk, self._batch_policy)

    def _start(self, job: Job) -> None:
        job.stats.started_at = time.perf_counter()
        job.stats.queued_ms = 1e3 * (job.stats.started_at - job.submitted_at)
        if self.metrics is not None:
            self.metrics.job_started(job)

    def _end(self, job: Job) -> None:
        with self._cond:
            if job in self._running:
                self._running.remove(job)
            if self.kv_budget is not None:
                self.kv_budget.release(id(job))
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.job_ended(job)

    def _finish(self, job: Job) -> None:
        """Post the end of a job that ran to its end or was cancelled."""
        stats = job.stats
        if job.cancelled.is_set():
            stats.cancelled = True
            stats.events_after_cancel = stats.n_events - (job.events_at_cancel or 0)
        if stats.cancelled and self._stopped:  # cut by shutdown: the client must see an error
            job.post(Failed(503, "the server shut down before this reply finished", "server_error"))
        else:
            job.post(Finished(stats))

    def _solo(self, job: Job):
        """`job` on a decoder of its own (a `BatchRun` of one row), or None if it failed to start."""
        from .batch import BatchRun

        self._start(job)
        cache = self.prompt_caches.checkout(job.prompt_ids) if self.prompt_caches is not None else None
        try:
            if self.session.lockstep is not None:  # the other ranks of a sharded target decode it too
                from ..core.distributed import announce

                announce(self.session.lockstep, job.prompt_ids)
            return BatchRun.solo(self.session, job, self.prefill_chunk, cache)
        except DFlashError as e:  # a bad request fails alone (refused before its cache was touched)
            failure = Failed(400, str(e))
        except Exception as e:  # noqa: BLE001 - a bug must reach the client as a 500, not kill the worker
            log.exception("generation failed for request %s", job.id)
            failure = Failed(500, f"internal error: {type(e).__name__}: {e}", "server_error")
            if cache is not None:
                cache.reset()  # what it covers is unknown
        if self.prompt_caches is not None:
            self.prompt_caches.checkin(cache)
        job.post(failure)
        self._end(job)
        return None

    def _step_batch(self, batch, solo: bool = False) -> None:
        """Drop cancelled rows, run one step of `batch` (a `BatchRun`), post its events."""
        for job in list(batch.jobs.values()):
            if job.cancelled.is_set():
                cache = batch.remove(job)  # covers the prompt and the reply so far: the next turn reuses it
                if cache is not None and self.prompt_caches is not None:
                    self.prompt_caches.checkin(cache)
                self._finish(job)
                self._end(job)
        if not batch:
            return
        try:
            produced = batch.step()
        except DFlashError as e:
            self._fail_batch(batch, Failed(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a bug must reach every client as a 500, not kill the worker
            log.exception("batched generation failed")
            self._fail_batch(batch, Failed(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
            return
        for job, error, cache in batch.take_failures():  # that row alone: the others go on
            if self.prompt_caches is not None and cache is not None:
                self.prompt_caches.checkin(cache)  # reset, so it holds nothing of the failed turn
            job.post(_row_failure(job, error))
            self._end(job)
        if self.metrics is not None:
            self.metrics.tokens_posted(sum(len(event.tokens) for _, event, _ in produced))
        for job, event, cache in produced:
            job.stats.observe(event)
            job.post(event)
            if event.finish_reason is not None:
                if self.prompt_caches is not None:
                    self.prompt_caches.checkin(cache)
                self._finish(job)
                self._end(job)
        if self.metrics is None:
            return
        if solo and produced and produced[0][1].cycle is not None:
            self.metrics.solo_cycle(batch.last_width, produced[0][0].stats.tokens_per_cycle)
        elif not solo:
            self.metrics.batch_cycle(batch.last_width, batch.rows_tau())
        self.metrics.prefill(*batch.prefilling())

    def _fail_batch(self, batch, failure: Failed) -> None:
        """Fail every row: a batch step that raised leaves the batch's state unknown, so the
        batch is dropped (emptied, the loop lets it go) and its caches are not reused."""
        jobs = list(batch.jobs.values())
        batch.jobs.clear()
        for job in jobs:
            job.post(failure)
            self._end(job)


def _row_failure(job: Job, error: Exception) -> Failed:
    """A batched row's own error as its client sees it: a bad request (400) or a bug (500)."""
    if isinstance(error, DFlashError):
        return Failed(400, str(error))
    log.error("batched row of request %s failed", job.id, exc_info=error)
    return Failed(500, f"internal error: {type(error).__name__}: {error}", "server_error")
