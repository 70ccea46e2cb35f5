"""The decoder: rows decoding speculatively together, per-row drafts, one batched verify.

Every reply decodes here, alone or beside others: `generate.stream_generate` is a decoder of
one row, and the server's worker schedules its requests over one.

Each row is an engine `_Run` (its own sampling, RNG key, drafter context, penalties, grammar,
history). A cycle of width w (the same for every row, chosen per cycle by a policy):

1. draft: the drafter drafts `w - 1` tokens for each row from that row's context (one call
   per row, as mlx-vlm does); w = 1 is a plain batched decoding step, with no drafts.
2. verify: the target runs once over `[B, w]`, each row's anchor and drafts, on batched
   caches (`batch_cache.py`) whose rows have different lengths.
3. commit: each row keeps its own accepted prefix (`Target.commit_rows`: attention slots
   are emptied per row, recurrent state replayed per row) and feeds those states to its
   context.

Token choice is the single-stream engine's own code (`draft`, `verdict`, `accepted`,
`_choose`), so every greedy row equals its single-stream output. Rows join between cycles:
a new row's prompt is prefilled alone, up to `prefill_step_size` tokens per `step` shared by
the joining rows (running rows keep decoding), then its single-row caches are appended to
the batch. A row that finishes leaves at once;
with a `PromptCache`, its caches go back into it.

A row decoding alone keeps its native single-row caches and runs the single-stream engine's
own cycle (`_next_cycle`: width capped by the tokens left, plain steps pipelined), so a batch
of one decodes as fast as `stream_generate`; its caches become ragged rows when a second row
is ready to join (never with a plain step queued ahead), and the last row left turns native
again.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import ConfigError
from . import batch_cache
from .distributed import Lockstep
from .engine import (
    CLEAR_CACHE_EVERY,
    DEFAULT_PREFILL_STEP,
    _can_pipeline,
    _choose,
    _logprob_list,
    _logprobs,
    _next_cycle,
    _pick_width,
    _prefill,
    _rank0_width,
    _Run,
    _take,
    _wired_limit,
    accepted,
    draft,
    generation_stream,
    generation_tps,
    peak_memory_gb,
    start_run,
    verdict,
)
from .events import CycleStats, GenerationEvent
from .interfaces import BatchPolicy, DraftModel, TargetModel, WidthPolicy
from .sampling import SamplingParams
from .stopper import Stopper

COMPACT_EVERY = 16  # cycles between packing away the slots rejected drafts left empty


@dataclass
class _Row:
    id: int
    run: _Run
    ids: list[int]  # the prompt: what the caches must cover before decoding
    n_prompt: int
    stopper: Stopper
    prompt_cache: object | None
    mark: object | None
    n_cached: int
    started: float
    on_prefill: object | None = None  # `(n_done, n_total) -> bool | None` before each prompt chunk
    prompt_tps: float = 0.0
    first_at: float | None = None


class SpeculativeBatch:
    """Rows decoding together; `add` a prompt, `step` once per turn, `remove` a cancelled row.

    Args:
        target: a `Target`; drafter: a bound `Drafter`, or None (plain batched decoding).
        block_size: the widest verify block (default the drafter's trained block size).
        policy: picks each cycle's width, `next_width(max_width, batch) -> int` and
            `observe(batch, cycle, rows)` (`BatchWidthPolicy`); None: always `block_size`.
        alone_policy: the `WidthPolicy` of a row decoding alone (default: `policy` at batch
            size 1).
        prefill_step_size: prompt tokens prefilled per `step` for a joining row.
        fast_greedy: plain steps of bare greedy rows take one argmax over the batch (False:
            each row's own `_choose`, the slow twin the tests compare).
        kv_bits, kv_group_size: quantized full-attention K/V (mlx-lm's `QuantizedKVCache`; in
            the batch, quantized `RaggedKVCache` rows that hold the same groups).
        overlap: a row alone builds its verify graph while its drafts compute (default: on GPU
            backends; on the CPU backend host work and kernels share the same cores).
        pipelined: a row alone queues its next plain step before reading the last token back,
            as mlx-lm does; False runs the one-step-at-a-time twin.
        lockstep: a `distributed.Lockstep` when the target is sharded over launched processes:
            one row at a time, rank 0's decisions hold for every rank (see `distributed.py`).
    """

    def __init__(self, target: TargetModel, drafter: DraftModel | None = None, *, block_size: int | None = None,
                 policy: BatchPolicy | None = None, alone_policy: WidthPolicy | None = None,
                 prefill_step_size: int = DEFAULT_PREFILL_STEP, fast_greedy: bool = True,
                 kv_bits: int | None = None, kv_group_size: int | None = None, overlap: bool | None = None,
                 pipelined: bool = True, lockstep: Lockstep | None = None):
        if drafter is not None and drafter.target is not target:
            raise ConfigError("the drafter is bound to a different target; call drafter.bind(target)")
        self.target, self.drafter, self.policy = target, drafter, policy
        self.max_width = block_size or (drafter.config.block_size if drafter is not None else 1)
        if drafter is not None and self.max_width < 2:
            raise ConfigError(f"block_size must be >= 2 for speculative decoding, got {self.max_width}")
        self.taps = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.prefill_step_size, self.fast_greedy = prefill_step_size, fast_greedy
        self.kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
        self.overlap = overlap if overlap is not None else mx.default_device() == mx.gpu
        self.pipelined, self.lockstep = pipelined, lockstep
        self.cache = batch_cache.empty_batch(target, **self.kv)
        self.rows: list[_Row] = []  # decoding, in the order of the batch's rows
        self.joining: collections.deque[_Row] = collections.deque()  # prompts being prefilled
        self.ready: list[_Row] = []  # prefilled, waiting for the row alone to finish a queued step
        self._ids = itertools.count()
        self.n_cycles = 0
        self.last_width = 0
        self.failures: list[tuple[int, Exception]] = []  # rows that failed alone, for `take_failures`
        self._alone_policy = alone_policy or (_OneRow(policy) if policy is not None and drafter is not None else None)
        self._wired: contextlib.ExitStack | None = None  # the wired-memory limit, held while rows exist

    @property
    def one_row(self) -> bool:
        """Whether rows decode one at a time: a target sharded over processes."""
        return self.lockstep is not None

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining) + len(self.ready)

    @property
    def alone(self) -> bool:
        """Whether one row decodes on its native caches (the single-stream engine's cycle)."""
        return len(self.rows) == 1 and self.rows[0].run.target_cache is not None

    # -- rows in and out ----------------------------------------------------------------------

    def add(self, prompt_ids: list[int], max_tokens: int, *, sampling: SamplingParams | None = None,
            stop=(), top_logprobs: int | None = None, constraint=None, prompt_cache=None, on_prefill=None) -> int:
        """Queue a row for `prompt_ids`; its prompt is prefilled over the next steps. Returns
        the row's id. `prompt_cache` (a `PromptCache` for this pair) supplies the prefix it
        reaches exactly and gets the row's caches back when it ends. `on_prefill(n_done,
        n_total)` runs before each prompt chunk; a False return cancels the row quietly."""
        if self.one_row and len(self):
            raise ConfigError(f"this decoder runs one row at a time (a target sharded over {self.lockstep.size} "
                              f"ranks); it has {len(self)} already")
        params = sampling or SamplingParams()
        ids = list(prompt_ids)
        run, n_cached, mark = start_run(self.target, self.drafter, ids, max_tokens, self.max_width, params,
                                        prompt_cache, top_logprobs=top_logprobs, constraint=constraint,
                                        prompt_len=len(ids), overlap=self.overlap, lockstep=self.lockstep,
                                        **self.kv)
        stopper = Stopper(self.target.tokenizer, self.target.eos_token_ids, list(stop), max_tokens)
        for policy in (self.policy, self._alone_policy):  # (the batch policy's one-row view does nothing)
            if policy is not None:
                policy.begin()
        row = _Row(next(self._ids), run, ids, len(ids), stopper, prompt_cache, mark, n_cached, time.perf_counter(),
                   on_prefill)
        self.joining.append(row)
        return row.id

    def _hold_wired(self) -> None:
        """Raise the wired-memory limit while any row exists, as a single stream does for its
        generation (mlx-lm's `wired_limit`; a no-op without Metal)."""
        if self._wired is None:
            self._wired = contextlib.ExitStack()
            self._wired.enter_context(_wired_limit(self.target.model))

    def _release_wired_if_empty(self) -> None:
        if self._wired is not None and not len(self):
            self._wired, wired = None, self._wired
            wired.close()

    def remove(self, row_id: int) -> None:
        """Drop a row (cancelled between steps); its prompt cache, if any, keeps what the row's
        caches cover (prompt and reply so far), as a cancelled single stream's does."""
        for row in list(self.joining):
            if row.id == row_id:
                self.joining.remove(row)
                if row.prompt_cache is not None:  # the prefill's chunks so far
                    row.prompt_cache.tokens = row.run.history[: row.run.fed]
        for row in [r for r in self.ready if r.id == row_id]:
            self.ready.remove(row)
            if row.prompt_cache is not None:  # its native caches cover the prompt
                row.prompt_cache.tokens = row.run.history[: row.run.fed]
        self._leave([r for r in self.rows if r.id == row_id])
        self._release_wired_if_empty()

    def _leave(self, leaving: list[_Row]) -> None:
        if not leaving:
            return
        gone = {r.id for r in leaving}
        if self.alone:  # its native caches are the prompt cache's already
            row = self.rows[0]
            if row.prompt_cache is not None:
                row.prompt_cache.tokens = row.run.history[: row.run.fed]
            self.rows = []
            _end_lockstep(row.run)
            return
        for b, row in enumerate(self.rows):
            if row.id in gone and row.prompt_cache is not None:
                pc = row.prompt_cache  # the caches cover history[:fed]: the pool's next turn starts there
                pc.target_cache = batch_cache.row_cache(self.cache, b, pc.reserve)
                pc.tokens = row.run.history[: row.run.fed]
        kept = [b for b, r in enumerate(self.rows) if r.id not in gone]
        batch_cache.keep_rows(self.cache, kept)
        self.rows = [self.rows[b] for b in kept]

    def _to_native(self) -> None:
        """The last row left in the batch takes its caches back as single-row ones."""
        run = self.rows[0].run
        pc = self.rows[0].prompt_cache
        run.target_cache = batch_cache.row_cache(self.cache, 0, max(self.max_width, pc.reserve if pc else 0))
        if pc is not None:
            pc.target_cache = run.target_cache  # the same objects, as a single stream shares them
        self.cache = batch_cache.empty_batch(self.target, **self.kv)

    def _settle(self) -> None:
        """Rows whose prefill is done start decoding: alone on their native caches when no
        other row decodes, else as ragged rows of the batch (the row alone first finishes any
        plain step it queued ahead: its caches must end where its history does). The last row
        left in the batch (the others finished, failed or were cancelled) turns native."""
        if not self.ready:
            if len(self.rows) == 1 and not self.alone:
                self._to_native()
            return
        if not self.rows and len(self.ready) == 1:
            self.rows.append(self.ready.pop())
            return
        if self.alone:
            run = self.rows[0].run
            if run.queued is not None or run.decided is not None:
                return
            batch_cache.add_rows(self.cache, [run.target_cache])
            run.target_cache = None
        batch_cache.add_rows(self.cache, [row.run.target_cache for row in self.ready])
        for row in self.ready:
            row.run.target_cache = None  # the batch owns the row's caches now
        self.rows += self.ready
        self.ready = []

    # -- one turn -----------------------------------------------------------------------------

    def step(self) -> list[tuple[int, GenerationEvent]]:
        """Up to `prefill_step_size` prompt tokens of the joining rows (oldest first) and one
        cycle of the decoding rows; (row id, event) for each row that produced tokens (a row
        whose event has a finish_reason has left)."""
        out = []
        if len(self):
            self._hold_wired()
        with mx.stream(generation_stream()):
            budget = self.prefill_step_size  # prompt tokens this step, shared by the joining rows in order
            while self.joining and budget > 0:
                row, fed = self.joining[0], self.joining[0].run.fed
                try:
                    out += self._prefill_chunk(row, budget)
                except Exception as e:  # noqa: BLE001 - this row's own failure (a grammar, a stop string)
                    self._fail_joining(row, e)
                    continue
                budget -= row.run.fed - fed
                if self.joining and self.joining[0] is row:
                    break  # its prompt goes on next step
            # A row prefilled in this step decodes from the next: its first token reaches the
            # client before a cycle runs, and a cancel in between stops it before any cycle.
            if self.alone:
                out += self._cycle_alone()
            elif self.rows:
                out += self._cycle()
            self._settle()
        self._release_wired_if_empty()
        return out

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The rows that failed since the last call (they have left; the others go on)."""
        failures, self.failures = self.failures, []
        return failures

    def _fail_joining(self, row: _Row, error: Exception) -> None:
        if row in self.joining:
            self.joining.remove(row)
        if row.prompt_cache is not None:
            row.prompt_cache.reset()  # mid-prefill or mid-turn: nothing in it can be trusted
        self.failures.append((row.id, error))

    def _drop_failed(self, failed: dict[int, Exception]) -> None:
        """Rows (by batch index) whose own processing raised leave without their caches."""
        for b in sorted(failed):
            row = self.rows[b]
            if row.prompt_cache is not None:
                row.prompt_cache.reset()
            self.failures.append((row.id, failed[b]))
        kept = [b for b in range(len(self.rows)) if b not in failed]
        batch_cache.keep_rows(self.cache, kept)
        self.rows = [self.rows[b] for b in kept]

    def _prefill_chunk(self, row: _Row, budget: int) -> list:
        """Prefill up to `budget` more prompt tokens of `row` (and, at the mark, the last one);
        a row whose prompt is done gets its first token and joins the batch."""
        run = row.run
        logits = _prefill(run, row.ids, budget, row.on_prefill, row.mark, budget)
        if run.cancelled:  # by its own `on_prefill`: it leaves quietly, its prompt cache keeps the chunks fed
            self.joining.popleft()
            if row.prompt_cache is not None:
                row.prompt_cache.tokens = run.history[: run.fed]
            return []
        if logits is None:
            return []
        self.joining.popleft()
        first_arr, rows = _choose(run, logits[0], [], run.next_key())
        if run.lockstep is not None:
            first_arr = run.lockstep.share(first_arr)
        first = int(first_arr.item())
        logprobs = _logprob_list(_logprobs(run, rows, first_arr), [first])
        row.prompt_tps = (len(row.ids) - row.n_cached) / max(time.perf_counter() - row.started, 1e-9)
        kept, finish = _take(run, row.stopper, [first])
        if finish is None:
            self.ready.append(row)
        else:
            if row.prompt_cache is not None:
                row.prompt_cache.tokens = run.history[: run.fed]
            _end_lockstep(run)
        return [(row.id, self._event(row, kept, None, finish, logprobs))]

    def _cycle(self) -> list:
        B = len(self.rows)
        left = max(row.stopper.max_tokens - len(row.stopper.tokens) for row in self.rows)
        w = 1 if self.drafter is None else min(self.max_width, left)  # no drafting past every row's limit
        if self.policy is not None and w > 1:
            w = max(1, min(self.policy.next_width(w, B), w))
        self.last_width = w
        t0 = time.perf_counter()
        runs = [r.run for r in self.rows]
        failed: dict[int, Exception] = {}  # batch index -> the error of that row alone
        if w >= 2:
            emitted, n_acc, infos, t1 = self._speculate(runs, w, failed)
        else:
            emitted, n_acc, infos, t1 = self._plain(runs, failed)
        t2 = time.perf_counter()
        cycle = CycleStats(w, w - 1, round(sum(n_acc) / B), 0, t1 - t0, t2 - t1)  # the policy's view: a mean row
        if self.policy is not None and self.drafter is not None:
            self.policy.observe(B, cycle, [(w - 1, n) for n in n_acc])
        out, done = [], []
        for b, (row, tokens, n, info) in enumerate(zip(self.rows, emitted, n_acc, infos)):
            if b in failed:
                continue
            try:
                kept, finish = _take(row.run, row.stopper, tokens)
            except Exception as e:  # noqa: BLE001 - this row's own failure
                failed[b] = e
                continue
            stats = CycleStats(w, w - 1, n, len(tokens), cycle.draft_s, cycle.verify_s)
            out.append((row.id, self._event(row, kept, stats, finish, info)))
            if finish is not None:
                done.append(row)
        gone = {id(row) for row in done}
        self._drop_failed(failed)  # before `_leave`: batch indices still as in this cycle
        self._leave([row for row in self.rows if id(row) in gone])
        self.n_cycles += 1
        if self.n_cycles % COMPACT_EVERY == 0:
            batch_cache.compact(self.cache)
        if self.n_cycles % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return out

    def _cycle_alone(self) -> list:
        """One cycle of the row decoding alone: the single-stream engine's, on its caches."""
        row = self.rows[0]
        run = row.run
        left = row.stopper.max_tokens - len(row.stopper.tokens)
        if run.lockstep is not None:  # rank 0 picks the width (its policy's) for every rank
            mine = _pick_width(run, self.max_width, left, self._alone_policy) if run.lockstep.leader else 0
            run.decided = _rank0_width(run, mine)
            if not run.decided:  # rank 0's row has ended
                self.rows = []
                return []
        pipeline = self.pipelined and not self.joining and not self.ready and _can_pipeline(run)
        try:  # (a joining row waits for no queued step)
            emitted, cycle, logprobs = _next_cycle(run, self.max_width, left, self._alone_policy, pipeline)
            kept, finish = _take(run, row.stopper, emitted)
        except Exception as e:  # noqa: BLE001 - this row's own failure, as in a batched cycle
            if row.prompt_cache is not None:
                row.prompt_cache.reset()
            self.failures.append((row.id, e))
            self.rows = []
            if run.lockstep is not None and run.lockstep.leader:
                _end_lockstep(run)  # the other ranks stop with it
            return []
        self.last_width = cycle.width
        self.n_cycles += 1
        if self.n_cycles % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        out = [(row.id, self._event(row, kept, cycle, finish, logprobs))]
        if finish is not None:
            self._leave([row])
        return out

    def _speculate(self, runs: list[_Run], w: int, failed: dict):
        blank = (None, mx.zeros((w - 1,), mx.int32), None, 0.0)  # a failed row's place in the verify
        proposals = [_guarded(failed, b, draft, run, w) or blank for b, run in enumerate(runs)]
        drafts = mx.stack([p[1].astype(mx.int32) for p in proposals])
        anchors = mx.array([[run.history[-1]] for run in runs], dtype=drafts.dtype)
        mx.eval(drafts)
        t1 = time.perf_counter()
        self.target.arm(self.cache)
        logits, hidden = self.target.forward(mx.concatenate([anchors, drafts], axis=1), self.cache, self.taps, "all")
        verdicts = [None if b in failed else _guarded(failed, b, verdict, run, logits[b], p[1], p[0], p[2])
                    for b, (run, p) in enumerate(zip(runs, proposals))]
        live = [v for v in verdicts if v is not None]
        mx.eval([v[0] for v in live], [[x for x in v[1] or () if x is not None] for v in live])
        emitted, n_acc, infos = [], [], []
        for b, (run, (_, d, _, _), v) in enumerate(zip(runs, proposals, verdicts)):
            picked = None if v is None else _guarded(failed, b, accepted, run, d.tolist(), v[0])
            if picked is None:  # a failed row keeps its anchor only, then leaves
                emitted.append([]), n_acc.append(0), infos.append(None)
                continue
            n, nxt = picked
            emitted.append(d.tolist()[:n] + [nxt])
            n_acc.append(n)
            infos.append(_logprob_list(v[1], emitted[-1]))
        self.target.commit_rows(self.cache, w, [n + 1 for n in n_acc])
        for b, (run, n) in enumerate(zip(runs, n_acc)):
            if b in failed:
                continue
            run.context.feed(hidden[b : b + 1, : n + 1])
            run.fed += n + 1
        return emitted, n_acc, infos, t1

    def _plain(self, runs: list[_Run], failed: dict):
        t1 = time.perf_counter()
        anchors = mx.array([[run.history[-1]] for run in runs])
        logits, hidden = self.target.forward(anchors, self.cache, self.taps, "all")
        if self.fast_greedy and all(_bare_greedy(run) for run in runs):  # one argmax for the whole batch
            emitted = [[t] for t in mx.argmax(logits[:, -1], axis=-1).tolist()]
            infos = [None] * len(runs)
        else:
            zero = (mx.array(0), None)  # a failed row's place
            picks = [_guarded(failed, b, _choose, run, logits[b], [], run.next_key()) or zero
                     for b, run in enumerate(runs)]
            infos = [None if b in failed else _logprobs(run, rows, token)
                     for b, (run, (token, rows)) in enumerate(zip(runs, picks))]
            mx.eval([t for t, _ in picks], [[x for x in i or () if x is not None] for i in infos])
            emitted = [[] if b in failed else [int(t.item())] for b, (t, _) in enumerate(picks)]
        for b, run in enumerate(runs):
            if run.context is not None:
                run.context.feed(hidden[b : b + 1])
            run.fed += 1
        return emitted, [0] * len(runs), [_logprob_list(i, e) for i, e in zip(infos, emitted)], t1

    def _event(self, row: _Row, tokens: list[int], cycle, finish, logprobs) -> GenerationEvent:
        row.first_at = row.first_at or time.perf_counter()
        n = len(row.stopper.tokens)
        stopper = row.stopper
        return GenerationEvent(stopper.new_text(finish is not None), tokens, cycle, finish, row.n_prompt,
                               row.prompt_tps, n, generation_tps(n, row.first_at),
                               peak_memory_gb(), stopper.matched if finish == "stop" else None,
                               logprobs[: len(tokens)] if logprobs is not None else None, row.n_cached)


class _OneRow:
    """The batch's width policy seen as a single stream's (`WidthPolicy`) at batch size 1."""

    def __init__(self, policy: BatchPolicy):
        self.policy = policy

    def begin(self) -> None:
        pass  # `add` began the reply

    def next_width(self, max_width: int) -> int:
        return self.policy.next_width(max_width, 1)

    def observe(self, cycle) -> None:
        self.policy.observe(1, cycle, [(cycle.n_drafted, cycle.n_accepted)])


def _end_lockstep(run: _Run) -> None:
    """A sharded row ends on every rank at once: rank 0 says "stop" (the others hear it)
    unless that was said already."""
    if run.lockstep is not None and not run.told_stop:
        _rank0_width(run, 0)


def _bare_greedy(run: _Run) -> bool:
    """Whether the row's plain pick is the bare argmax (no penalties, grammar or log-probabilities)."""
    return run.params.greedy and not run.processors and run.constraint is None and run.top_logprobs is None


def _guarded(failed: dict, b: int, fn, *args):
    """`fn(*args)` for row `b`, or None with the error kept in `failed`: one row's grammar,
    processors or stop strings failing must not fail the rows beside it."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to that row's client (400 or 500)
        failed[b] = e
        return None
