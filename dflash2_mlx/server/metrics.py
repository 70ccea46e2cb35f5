"""Server counters and their Prometheus text exposition (format 0.0.4).

The worker thread reports job starts and ends; an ASGI middleware reports every response's
status. All updates take one lock, so `/metrics` always reads a consistent snapshot.
"""

from __future__ import annotations

import collections
import json
import math
import threading
import time
from collections import Counter

from ..core.stats import tau_from_counts

# Routes counted by name; anything else is counted as "other" so that scanners probing random
# paths cannot grow the label set without bound.
KNOWN_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
    "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/version", "/api/ps", "/openapi.json", "/",
    "/docs", "/v1/messages", "/v1/messages/count_tokens",
})


RATE_WINDOW_S = 10.0


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    """Counters for requests, tokens, speculation (τ) and the queue."""

    def __init__(self, info: dict | None = None, prompt_caches=None, request_log: str | None = None):
        self._lock = threading.Lock()
        self.request_log = request_log  # a JSON-lines file: one line per finished job, or None
        self.prompt_caches = prompt_caches  # a PromptCachePool, whose own counters are read at render
        self.info = dict(info or {})
        self.started = time.time()
        self.responses: Counter = Counter()
        self.jobs: Counter = Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.cycles = 0
        self.speculative_cycles = 0
        self.prompt_seconds = 0.0
        self.generation_seconds = 0.0
        self.queue_wait_seconds = 0.0
        self.job_seconds = 0.0
        self.max_events_after_cancel = 0
        self.depth = 0
        self.running = 0
        self.batch = 0
        self.batch_max = 0
        self.solo_width = 0  # the single-stream reply's last verify width (0: none running)
        self.solo_tau = 0.0  # its tokens per speculative cycle so far
        self.batch_width = 0  # the batch's last verify width (1: plain batched decoding; 0: no batch)
        self.batch_tau: list[float] = []  # each batched row's tokens per speculative cycle so far
        self._recent: collections.deque = collections.deque()  # (time, tokens) posted, for the rate
        self.prefill_done = 0
        self.prefill_total = 0
        self.prefill_chunks = 0
        self._job_started: dict[str, float] = {}

    # -- updates --------------------------------------------------------------------

    def response(self, route: str, status: int) -> None:
        route = route if route in KNOWN_ROUTES else "other"
        with self._lock:
            self.responses[(route, str(status))] += 1

    def queue_depth(self, depth: int) -> None:
        with self._lock:
            self.depth = depth

    def tokens_posted(self, n: int, now: float | None = None) -> None:
        """`n` tokens went out to clients (any job); feeds the aggregate rate over RATE_WINDOW_S."""
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def aggregate_tps(self, now: float | None = None) -> float:
        """Tokens per second to all clients over the last RATE_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        return sum(n for t, n in self._recent if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S

    def solo_cycle(self, width: int, tau: float) -> None:
        """The single-stream (seeded) reply's last cycle: its width (1 a plain step; 0 when it
        ended) and its τ so far."""
        with self._lock:
            self.solo_width, self.solo_tau = width, tau

    def batch_cycle(self, width: int, rows_tau: list[float]) -> None:
        """The batch's last cycle: its verify width (1: plain batched decoding) and each running
        row's τ so far."""
        with self._lock:
            self.batch_width = width
            self.batch_tau = rows_tau

    def batch_size(self, n: int) -> None:
        """Rows decoding together in the batch now (the solo job not counted)."""
        with self._lock:
            self.batch = n
            self.batch_max = max(self.batch_max, n)

    def prefill(self, done: int, total: int) -> None:
        """The running job's prompt progress (0/0 when none is prefilling)."""
        with self._lock:
            self.prefill_done, self.prefill_total = done, total
            self.prefill_chunks += done < total

    def job_started(self, job) -> None:
        with self._lock:
            self._job_started[job.id] = time.perf_counter()
            self.running = len(self._job_started)

    def job_ended(self, job) -> None:
        s = job.stats
        outcome = "cancelled" if s.cancelled else ("completed" if s.finish_reason else "failed")
        with self._lock:
            started = self._job_started.pop(job.id, None)
            if started is not None:
                self.running = len(self._job_started)
                self.prefill_done = self.prefill_total = 0
                self.job_seconds += time.perf_counter() - started
            self.jobs[outcome] += 1
            self.prompt_tokens += s.prompt_n
            self.generated_tokens += s.predicted_n
            self.draft_tokens += s.draft_n
            self.draft_accepted += s.draft_n_accepted
            self.cycles += s.n_cycles
            self.speculative_cycles += s.n_speculative
            self.prompt_seconds += s.prompt_ms / 1e3
            self.generation_seconds += s.predicted_ms / 1e3
            self.queue_wait_seconds += s.queued_ms / 1e3
            self.max_events_after_cancel = max(self.max_events_after_cancel, s.events_after_cancel)
        if self.request_log:
            line = {"time": round(time.time(), 3), "id": job.id, "endpoint": job.endpoint, "outcome": outcome,
                    "queued_ms": round(s.queued_ms, 1), "finish_reason": s.finish_reason, **s.timings()}
            with open(self.request_log, "a") as f:
                f.write(json.dumps(line) + "\n")

    # -- reads ----------------------------------------------------------------------

    def retry_after(self, depth: int) -> int:
        """Seconds a rejected client should wait: mean job time x jobs ahead, in [1, 60]."""
        with self._lock:
            n = sum(self.jobs.values())
            mean = self.job_seconds / n if n else 1.0
        return int(min(60, max(1, math.ceil(mean * max(depth, 1)))))

    def tokens_per_cycle(self) -> float:
        return tau_from_counts(self.draft_accepted, self.speculative_cycles)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            rows = self._rows()
        if self.prompt_caches is not None:
            rows += _pool_rows(self.prompt_caches.snapshot())
        out = []
        for name, kind, help_text, samples in rows:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)
        return "\n".join(out) + "\n"

    def _rows(self) -> list:
        acceptance = self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0
        return [
            ("dflash2_info", "gauge", "Loaded model pair and version.", [(self.info, 1)]),
            ("dflash2_uptime_seconds", "gauge", "Seconds since the server started.",
             [({}, round(time.time() - self.started, 3))]),
            ("dflash2_requests_total", "counter", "HTTP responses by route and status.",
             [({"route": r, "status": s}, n) for (r, s), n in sorted(self.responses.items())]),
            ("dflash2_jobs_total", "counter", "Generation jobs by outcome.",
             [({"outcome": o}, self.jobs.get(o, 0)) for o in ("completed", "cancelled", "failed")]),
            ("dflash2_prompt_tokens_total", "counter", "Prompt tokens processed.", [({}, self.prompt_tokens)]),
            ("dflash2_generated_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)]),
            ("dflash2_draft_tokens_total", "counter", "Tokens proposed by the drafter.", [({}, self.draft_tokens)]),
            ("dflash2_draft_tokens_accepted_total", "counter", "Drafted tokens the target accepted.",
             [({}, self.draft_accepted)]),
            ("dflash2_cycles_total", "counter", "Decoding cycles (speculative or plain).", [({}, self.cycles)]),
            ("dflash2_speculative_cycles_total", "counter", "Draft-verify cycles.", [({}, self.speculative_cycles)]),
            ("dflash2_tokens_per_cycle", "gauge", "Mean tokens per speculative cycle (tau), bonus included.",
             [({}, round(self.tokens_per_cycle(), 6))]),
            ("dflash2_draft_acceptance_ratio", "gauge", "Accepted / drafted tokens.", [({}, round(acceptance, 6))]),
            ("dflash2_prompt_seconds_total", "counter", "Seconds spent in prefill.",
             [({}, round(self.prompt_seconds, 6))]),
            ("dflash2_generation_seconds_total", "counter", "Seconds spent decoding.",
             [({}, round(self.generation_seconds, 6))]),
            ("dflash2_queue_wait_seconds_total", "counter", "Seconds jobs waited in the queue.",
             [({}, round(self.queue_wait_seconds, 6))]),
            ("dflash2_queue_depth", "gauge", "Jobs waiting for the generation worker.", [({}, self.depth)]),
            ("dflash2_requests_running", "gauge", "Jobs the generation worker is running (solo and batched).",
             [({}, self.running)]),
            ("dflash2_batch_size", "gauge", "Jobs decoding together in the batch now.", [({}, self.batch)]),
            ("dflash2_batch_size_max", "gauge", "The largest batch so far.", [({}, self.batch_max)]),
            ("dflash2_generated_tokens_per_second", "gauge",
             f"Tokens to all clients per second over the last {RATE_WINDOW_S:g} s (aggregate).",
             [({}, round(self.aggregate_tps(), 3))]),
            ("dflash2_solo_width", "gauge", "Verify width of the single-stream reply's last cycle (1: a plain "
             "step; 0: none running).", [({}, self.solo_width)]),
            ("dflash2_batch_width", "gauge", "Verify width of the batch's last cycle, the same for every row "
             "(1: plain batched decoding, where speculation does not pay at this batch size; 0: no batch).",
             [({}, self.batch_width if self.batch else 0)]),
            ("dflash2_batch_row_tokens_per_cycle", "gauge", "Tokens per speculative cycle of the batched "
             "rows' replies so far (tau per row: min, mean, max; 0 without a batch).",
             [({"stat": k}, round(v, 6)) for k, v in _spread(self.batch_tau if self.batch else [])]),
            ("dflash2_solo_tokens_per_cycle", "gauge", "Tokens per speculative cycle of the running "
             "single-stream reply (its tau so far; 0 when none).", [({}, round(self.solo_tau, 6))]),
            ("dflash2_prefill_tokens_done", "gauge", "Prompt tokens of the running job prefilled so far.",
             [({}, self.prefill_done)]),
            ("dflash2_prefill_tokens_total", "gauge", "Prompt tokens of the running job (0 when idle).",
             [({}, self.prefill_total)]),
            ("dflash2_prefill_chunks_total", "counter", "Prompt chunks prefilled (cancellation is checked "
             "before each).", [({}, self.prefill_chunks)]),
            ("dflash2_cycles_after_cancel_max", "gauge",
             "Most cycles any cancelled job ran after its cancel (should be <= 1).",
             [({}, self.max_events_after_cancel)]),
        ]


def _pool_rows(s) -> list:
    return [
        ("dflash2_prompt_cache_hits_total", "counter", "Requests that reused a cached prompt prefix.",
         [({}, s.hits)]),
        ("dflash2_prompt_cache_misses_total", "counter", "Requests whose prompt was prefilled cold.", [({}, s.misses)]),
        ("dflash2_prompt_cache_evictions_total", "counter", "Prompt caches evicted to fit --prompt-cache-bytes.",
         [({}, s.evictions)]),
        ("dflash2_prompt_cache_tokens_total", "counter", "Prompt tokens supplied by the prompt cache.",
         [({}, s.cached_tokens)]),
        ("dflash2_prompt_cache_bytes", "gauge", "Bytes held by idle prompt caches.", [({}, s.bytes)]),
        ("dflash2_prompt_cache_entries", "gauge", "Idle prompt caches held.", [({}, s.entries)]),
    ]


def parse(text: str) -> dict:
    """Prometheus text → {'name{labels}': value}; for tests and scripts reading /metrics."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _spread(values: list[float]) -> list[tuple[str, float]]:
    if not values:
        return [("min", 0.0), ("mean", 0.0), ("max", 0.0)]
    return [("min", min(values)), ("mean", sum(values) / len(values)), ("max", max(values))]
