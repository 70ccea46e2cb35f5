"""Requests that arrive while others run decode together, in one batch (mlx-lm's BatchGenerator).

The worker gives the first request in flight the single-stream engine (speculative decoding,
the prefix cache); requests that arrive while it runs join a `BatchRun`: mlx-lm's
`BatchGenerator` decodes all of them plainly, one token per row per step, rows joining and
leaving between steps and prompts prefilled in chunks. Speculation stops paying as the batch
grows (a batched verify reads the weights once per row block); until the engine verifies
batches itself, batched rows decode plainly, which is what mlx-lm's own server does.

Each row keeps the engine's `_Stopper` (EOS, stop strings, max_tokens, text) and gets events of
the engine's shape, so the API layers cannot tell a batched reply from a single-stream one.
A row is batchable when nothing in it needs the single-stream engine: no grammar, no
log-probabilities, no seed (a seeded reply must not depend on its neighbours), no penalties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine import CycleStats, GenerationEvent, _Stopper, generation_stream, peak_memory_gb


def batchable(job) -> bool:
    """Whether `job` can decode in the batch (see the module docstring)."""
    s = job.sampling
    penalties = s.repetition_penalty not in (0.0, 1.0) or s.presence_penalty or s.frequency_penalty
    return job.constraint is None and job.top_logprobs is None and s.seed is None and not penalties


def can_adopt(cache) -> bool:
    """Whether a single-stream reply's caches can move into the batch: mlx-lm's own KV caches
    (the rolled-back window and recurrent kinds of the engine are not its batch kinds)."""
    from mlx_lm.models.cache import KVCache

    return cache is not None and all(type(c) is KVCache for c in cache.target_cache)


def _sampler(s):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)


@dataclass
class _Row:
    job: object
    stopper: _Stopper
    last: float  # when the previous token of this row came back (perf_counter)
    first_at: float | None = None
    cached: int = 0  # prompt tokens the prefix cache supplied


class BatchRun:
    """The running batch: `add` a job, `step` once per worker turn, `remove` a cancelled one."""

    def __init__(self, target, max_batch: int, prefill_chunk: int):
        from mlx_lm.generate import BatchGenerator

        self.target = target
        # On this (the worker's) thread's generation stream: MLX streams belong to their thread.
        self.generator = BatchGenerator(target.model, stop_tokens=[[t] for t in sorted(target.eos_token_ids)],
                                        completion_batch_size=max_batch, prefill_batch_size=min(8, max_batch),
                                        prefill_step_size=prefill_chunk, stream=generation_stream())
        self.max_batch = max_batch
        self.rows: dict[int, _Row] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_batch

    def add(self, job, cache=None) -> int:
        """Start `job` in the batch; `cache` (a `PromptCache` copy the batch may keep, see
        `can_adopt`) supplies the prefix of the prompt it reaches exactly. Returns how many
        prompt tokens it supplied."""
        ids, caches, n = list(job.prompt_ids), None, 0
        if can_adopt(cache):
            n = cache.reuse(ids).n_cached
            caches = [cache.target_cache] if n else None
        (uid,) = self.generator.insert([ids[n:]], max_tokens=[job.max_tokens], samplers=[_sampler(job.sampling)],
                                       caches=caches)
        stopper = _Stopper(self.target.tokenizer, self.target.eos_token_ids, list(job.stop), job.max_tokens)
        self.rows[uid] = _Row(job, stopper, time.perf_counter(), cached=n if caches else 0)
        return self.rows[uid].cached

    def adopt(self, job, cache, emitted: list[int], sent: int) -> None:
        """Continue a reply the single-stream engine started: `cache` (a `PromptCache` whose
        target caches are plain KV caches, see `can_adopt`) covers a prefix of prompt +
        `emitted`; `sent` characters of the text went out already."""
        history = list(job.prompt_ids) + list(emitted)
        n = len(cache.tokens)
        if n >= len(history):  # the last token is in the cache (a queued plain step): feed it again
            for c in cache.target_cache:
                c.trim(n - len(history) + 1)
            n = len(history) - 1
        (uid,) = self.generator.insert([history[n:]], max_tokens=[job.max_tokens - len(emitted)],
                                       caches=[cache.target_cache], samplers=[_sampler(job.sampling)])
        stopper = _Stopper(self.target.tokenizer, self.target.eos_token_ids, list(job.stop), job.max_tokens)
        stopper.prime(emitted, sent)
        now = time.perf_counter()
        self.rows[uid] = _Row(job, stopper, now, first_at=job.stats.first_token_at or now)

    def remove(self, job) -> None:
        for uid, row in list(self.rows.items()):
            if row.job is job:
                self.generator.remove([uid])
                del self.rows[uid]

    def step(self) -> list[tuple[object, GenerationEvent]]:
        """One batch step; (job, event) for each row that produced a token (a finished row's
        event has its finish_reason and the row is gone from the batch)."""
        _, responses = self.generator.next()
        now = time.perf_counter()
        out = []
        for r in responses:
            row = self.rows.get(r.uid)
            if row is None:  # removed (cancelled) after it was scheduled
                continue
            out.append((row.job, self._event(row, r, now)))
        return out

    def _event(self, row: _Row, r, now: float) -> GenerationEvent:
        kept, finish = row.stopper.feed([int(r.token)])
        if finish is None and r.finish_reason is not None:
            finish = "length" if r.finish_reason == "length" else "stop"
        if finish is not None:
            del self.rows[r.uid]
            if r.finish_reason is None:  # a stop string: the generator does not know
                self.generator.remove([r.uid])
        cycle = None if row.first_at is None else CycleStats(1, 0, 0, 1, 0.0, now - row.last)
        row.first_at = row.first_at or now
        row.last = now
        n = len(row.stopper.tokens)
        elapsed = max(now - row.first_at, 1e-9)
        return GenerationEvent(row.stopper.new_text(finish is not None), kept, cycle, finish,
                               len(row.job.prompt_ids), 0.0, n, (n - 1) / elapsed if n > 1 else 0.0,
                               peak_memory_gb(), row.stopper.matched if finish == "stop" else None,
                               cached_tokens=row.cached)
