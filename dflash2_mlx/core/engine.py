"""One row's cycle: prefill → (draft → verify → commit)* with exact rollback.

The primitives every decoding path is written with, once: plain autoregressive steps
(`drafter=None`, or a cycle of width 1) and speculative cycles share every line that picks
tokens. The decoder (`batch_engine.SpeculativeBatch`) runs them for one row on its native
caches, and calls `draft`, `verdict` and `accepted` per row around one batched verify when
rows decode together; `generate.stream_generate` is a decoder of one row. Each cycle:

1. draft: the drafter, whose `DraftContext` holds the target states of the tokens committed
   since its last call, drafts `width - 1` tokens after the anchor (the last committed token).
2. verify: the target runs once over `[anchor, d_1..d_{w-1}]`; greedy prefix acceptance or
   rejection sampling picks `n` drafts and the next token.
3. commit: caches keep the anchor and the `n` accepted drafts; their target states are fed to
   the drafter's context; emitted = accepted drafts + the next token.

State is explicit in `_Run` (caches, RNG key, history); nothing is stored on the models.
A drafted token equal to the drafter's mask id is an ordinary token.

Glossary: *width* (the `block_size` argument, `CycleStats.width`) is the verify block, the
anchor plus `width - 1` drafts; *τ* is tokens emitted per speculative cycle (`stats.tau`).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import ConfigError
from .distributed import Lockstep
from .events import CycleStats, TokenLogprob
from .interfaces import Constraint, DraftModel, TargetModel, WidthPolicy
from .sampling import SamplingParams, make_processors, process_rows, target_probs
from .stopper import Stopper
from .verify import dense_q, greedy_accept, one_hot_q, rejection_sample

DEFAULT_PREFILL_STEP = 2048
_STREAMS = threading.local()  # MLX streams belong to the thread that made them
CLEAR_CACHE_EVERY = 64  # cycles (about mlx-lm's 256 tokens at 4 tokens per cycle)


@dataclass
class _Run:
    target: TargetModel
    drafter: DraftModel | None
    params: SamplingParams
    key: mx.array
    target_cache: list
    context: object | None  # the drafter's `DraftContext`, or None without a drafter
    taps: tuple[int, ...]
    history: list[int]
    processors: list
    fed: int = 0  # tokens of `history` the target's caches (and the drafter's context) cover
    top_logprobs: int | None = None  # report log-probabilities (with this many alternatives) when set
    overlap: bool = True  # build the verify graph while the drafts compute
    queued: tuple | None = None  # the next plain step's (token, logprobs), queued but not read back
    decided: int | None = None  # the next cycle's width, picked while that token was queued
    constraint: Constraint | None = None  # masks the target's rows (a grammar, a thinking budget), or None
    lockstep: Lockstep | None = None  # set when the target is sharded over processes
    told_stop: bool = False  # sharded: rank 0's last word was "stop"
    cancelled: bool = False  # the prefill was stopped by its `on_prefill`

    @property
    def follows(self) -> bool:
        """A rank other than 0 of a sharded target: it verifies what rank 0 drafts and decides."""
        return self.lockstep is not None and not self.lockstep.leader

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def generation_stream():
    """This thread's dedicated stream for generation work (as mlx-lm keeps one of its own)."""
    stream = getattr(_STREAMS, "stream", None)
    if stream is None:
        stream = _STREAMS.stream = mx.new_stream(mx.default_device())
    return stream


def _wired_limit(model):
    """mlx-lm's context that raises the wired-memory limit for a generation (no-op without Metal)."""
    from mlx_lm.generate import wired_limit

    return wired_limit(model)


def generation_tps(n_tokens: int, since: float) -> float:
    """Tokens per second since the first token was ready at `since` (the first one counted, as
    mlx-lm's `stream_generate` reports it); one rule for the single stream and the batch's rows."""
    return n_tokens / max(time.perf_counter() - since, 1e-9)


def peak_memory_gb() -> float:
    """MLX's peak allocation; where the backend does not track it (CPU), the process's peak RSS."""
    peak = mx.get_peak_memory()
    if peak:
        return peak / 1e9
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


def _check_args(target, drafter, ids: list[int], max_tokens: int, block_size: int) -> None:
    if not ids:
        raise ConfigError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < target.info.vocab_size]
    if bad:
        raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocab (size {target.info.vocab_size})")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if drafter is not None and block_size < 2:
        raise ConfigError(f"block_size must be >= 2 for speculative decoding, got {block_size}")
    if drafter is not None and drafter.target is not target:
        raise ConfigError("the drafter is bound to a different target; call drafter.bind(target)")


def _prefill(run: _Run, ids: list[int], step: int, on_prefill=None, mark=None,
             budget: int | None = None) -> mx.array | None:
    """Feed `ids[run.fed:]` in chunks of `step`; return the logits of the last position [1, 1, V]
    once the prompt is in, else None (budget spent, or cancelled: `run.cancelled`).

    `budget` bounds the tokens fed by this call (whole chunks; a decoder interleaves other rows'
    cycles between calls). `on_prefill(n_done, n_total)` runs before each chunk; a False return
    cancels, so a long prompt can be stopped between chunks. `mark(n)`, if given, runs when the
    caches cover all but the last prompt token.

    The last prompt token is always a pass of its own, as in mlx-lm's `generate_step`: logits
    move with a pass's shape, so a reply at a near-tie would otherwise depend on whether a
    prompt cache supplied the rest of the prompt.
    """
    first = run.fed
    bounds = list(range(run.fed, len(ids), step))
    if run.fed < len(ids) - 1 and len(ids) - 1 not in bounds:
        bounds = sorted(bounds + [len(ids) - 1])
    logits = None
    for start, end in zip(bounds, bounds[1:] + [len(ids)]):
        if budget is not None and start - first >= budget and start != len(ids) - 1:
            return None  # the last token's one-token pass goes with the chunk before it
        go = on_prefill is None or on_prefill(start, len(ids)) is not False
        if not _rank0_says(run, go):
            run.cancelled = True
            return None
        if mark is not None and start == len(ids) - 1:
            mark(run.fed)
        # sharded over tensors, rank 0's taps may need the last layer, whose collectives every
        # rank must then run too: each chunk runs to its logits on every rank
        to_end = end == len(ids) or (run.lockstep is not None and run.lockstep.mode == "tensor")
        logits, hidden = run.target.forward(mx.array([ids[start:end]]), run.target_cache, run.taps,
                                            "last" if to_end else "none")
        if hidden is not None:
            run.context.feed(hidden)
        run.fed = end
        mx.eval([c.state for c in run.target_cache], run.context.pending if run.context is not None else [],
                logits if to_end and end < len(ids) else [])
    return logits


def _choose(run: _Run, logits: mx.array, block: list[int], key: mx.array) -> tuple[mx.array, mx.array]:
    """The target's own pick for each row of logits [R, V] (greedy or sampled), and the rows
    after penalties (what log-probabilities are reported from)."""
    logits = process_rows(logits, run.history, block, run.processors, run.params.penalty_context)
    if run.constraint is not None:
        logits = run.constraint.apply(logits, [])
    if run.params.greedy:
        return mx.argmax(logits, axis=-1), logits
    return mx.random.categorical(mx.log(target_probs(logits, run.params)), key=key), logits


def _logprobs(run: _Run, rows: mx.array, tokens: mx.array):
    """Lazy (logprob of each row's token, top ids, top logprobs) for rows [R, V], as mlx-lm
    reports them: log-softmax of the logits after penalties, before temperature; None if off."""
    if run.top_logprobs is None:
        return None
    lp = rows.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1), axis=-1)[:, 0]
    k = min(run.top_logprobs, lp.shape[-1])
    if k == 0:
        return chosen, None, None
    top = mx.argsort(-lp, axis=-1)[:, :k]
    return chosen, top, mx.take_along_axis(lp, top, axis=-1)


def _logprob_list(info, tokens: list[int]) -> list[TokenLogprob] | None:
    """Host-side `TokenLogprob`s for the first len(tokens) rows of evaluated `_logprobs` output."""
    if info is None:
        return None
    chosen, top, top_lp = (x.tolist() if x is not None else None for x in info)
    return [TokenLogprob(t, chosen[i], list(zip(top[i], top_lp[i])) if top is not None else [])
            for i, t in enumerate(tokens)]


def _queue_plain(run: _Run, token_in: mx.array) -> tuple:
    """Queue one plain decoding step after `token_in` (host or lazy); (token, logprobs) stay lazy."""
    logits, hidden = run.target.forward(token_in.reshape(1, 1), run.target_cache, run.taps, "last")
    token, rows = _choose(run, logits[0], [], run.next_key())
    if run.lockstep is not None:
        token = run.lockstep.share(token)
    run.fed += 1
    if hidden is not None:
        run.context.feed(hidden)
    info = _logprobs(run, rows, token)
    mx.async_eval(token, *(x for x in info or () if x is not None))
    return token, info


def _step_plain(run: _Run, lookahead=None) -> tuple[list[int], CycleStats, list | None]:
    """One plain step. With `lookahead` (a function giving the next cycle's width), a next
    plain step is queued before this token is read back, as mlx-lm's `generate_step` does,
    so graph building overlaps compute; without it, the step-by-step twin."""
    t0 = time.perf_counter()
    current, info = run.queued if run.queued is not None else _queue_plain(run, mx.array([run.history[-1]]))
    run.queued = None
    if lookahead is not None:
        run.decided = lookahead()
        if run.decided == 1:
            run.queued = _queue_plain(run, current)
    token = int(current.item())
    return [token], CycleStats(1, 0, 0, 1, 0.0, time.perf_counter() - t0), _logprob_list(info, [token])


def _step_speculative(run: _Run, width: int) -> tuple[list[int], CycleStats]:
    """One draft-verify cycle. With `run.overlap` the drafts compute while the host builds the
    verify graph, and the verify is queued right behind them; otherwise the drafts are
    evaluated first. Either way, the drafts' finish time splits the cycle into `draft_s` and
    `verify_s`, host-side grammar time taken out of each."""
    if run.follows:
        return _follow_speculative(run, width)
    t0 = time.perf_counter()
    anchor = run.history[-1]
    proposal, drafts, allowed, walk_s = draft(run, width)
    # Drafts evaluated on the host are done now. Evaluated again once the verify is queued, they
    # would wait for it too on the CPU, and the verify's time would be booked as drafting.
    t1 = time.perf_counter() if _drafts_on_host(run) and run.lockstep is None else None
    if run.lockstep is not None:  # the same drafts on every rank, then (accepted, next) below
        drafts = run.lockstep.share(drafts)
        if run.target.pipelined:  # before the verify: a stage's receive does not wait on them in the graph
            mx.eval(drafts)
    run.target.arm(run.target_cache)
    verify_in = mx.concatenate([mx.array([anchor], dtype=drafts.dtype), drafts])[None]
    logits, hidden = run.target.forward(verify_in, run.target_cache, run.taps, "all")
    outputs, info, verdict_s = verdict(run, logits[0], drafts, proposal, allowed)
    mx.async_eval(*outputs, *(x for x in info or () if x is not None))
    before_t1_s = walk_s  # host grammar time inside the draft span
    if t1 is None:
        mx.eval(drafts)
        t1 = time.perf_counter()
        before_t1_s += verdict_s
    mx.eval(*outputs)
    draft_list = drafts.tolist()
    n_acc, nxt = accepted(run, draft_list, outputs)
    if run.lockstep is not None:
        n_acc, nxt = run.lockstep.share(mx.array([n_acc, nxt])).tolist()
    run.target.commit(run.target_cache, n_fed=width, n_keep=n_acc + 1)
    run.context.feed(hidden[:, : n_acc + 1])
    run.fed += n_acc + 1
    emitted = draft_list[:n_acc] + [nxt]
    t2 = time.perf_counter()
    grammar_s = walk_s + verdict_s
    return emitted, CycleStats(width, width - 1, n_acc, len(emitted), t1 - t0 - before_t1_s,
                               t2 - t1 - (grammar_s - before_t1_s), grammar_s), \
        _logprob_list(info, emitted)


def _follow_speculative(run: _Run, width: int) -> tuple[list[int], CycleStats, None]:
    """A following rank's cycle: verify rank 0's drafts (the collective half of the pass) and
    keep what rank 0 decided."""
    t0 = time.perf_counter()
    drafts = run.lockstep.share(mx.zeros((width - 1,), mx.int32))
    if run.target.pipelined:  # as rank 0 does, before the verify
        mx.eval(drafts)
    run.target.arm(run.target_cache)
    verify_in = mx.concatenate([mx.array([run.history[-1]], dtype=mx.int32), drafts])[None]
    logits, _ = run.target.forward(verify_in, run.target_cache, (), "last")
    mx.eval(logits)  # the whole pass, so its collectives match rank 0's (which reads every row)
    n_acc, nxt = run.lockstep.share(mx.zeros((2,), mx.int32)).tolist()
    run.target.commit(run.target_cache, n_fed=width, n_keep=n_acc + 1)
    run.fed += n_acc + 1
    emitted = drafts.tolist()[:n_acc] + [nxt]
    return emitted, CycleStats(width, width - 1, n_acc, len(emitted), 0.0, time.perf_counter() - t0), None


def _drafts_on_host(run: _Run) -> bool:
    """Whether `draft` evaluates the drafts before the verify is built: penalties and grammars
    read them on the host, and without overlap they run first."""
    return bool(run.processors) or run.constraint is not None or not run.overlap


def draft(run: _Run, width: int):
    """Draft `width - 1` tokens after the run's last token: (proposal, drafts [width - 1]
    (lazy unless the host needs them), the grammar's allowed sets or None, grammar seconds).
    Under a grammar with masked drafts, forbidden drafts are repaired before the verify."""
    proposal = run.drafter.draft(mx.array([run.history[-1]]), run.context, width, run.params.temperature,
                                 run.next_key())
    drafts = proposal.tokens[0]
    if _drafts_on_host(run):
        mx.eval(drafts)
    else:
        mx.async_eval(drafts)
    allowed, grammar_s = None, 0.0
    if run.constraint is not None and run.params.greedy and run.constraint.mask_drafts:  # before the verify
        g0 = time.perf_counter()
        repaired, allowed = run.constraint.walk(drafts.tolist(), lambda: _candidates(proposal))
        drafts = mx.array(repaired, dtype=drafts.dtype)
        grammar_s = time.perf_counter() - g0
    return proposal, drafts, allowed, grammar_s


def verdict(run: _Run, logits: mx.array, drafts: mx.array, proposal, allowed):
    """The target's verdict on one row's block from its verify logits [width, V], lazily:
    (outputs: (argmax rows,) when greedy, else (n_accepted, next token) of rejection
    sampling; logprob info or None; grammar seconds)."""
    rows = process_rows(logits, run.history, drafts.tolist() if run.processors else [], run.processors,
                        run.params.penalty_context)
    grammar_s = 0.0
    if run.constraint is not None:  # each row masked by the grammar state along the draft path
        g0 = time.perf_counter()
        rows = run.constraint.apply(rows, drafts.tolist(), allowed)
        grammar_s = time.perf_counter() - g0
    if run.params.greedy:
        outputs = (mx.argmax(rows, axis=-1),)
    else:
        p = target_probs(rows, run.params)
        q = dense_q(proposal.q[0], proposal.candidates[0], p.shape[-1]) if proposal.q is not None \
            else one_hot_q(drafts, p.shape[-1])
        outputs = rejection_sample(drafts, p, q, run.next_key())
    # Row j's reported token is the j-th emitted one: draft j+1 while accepted, then the pick.
    info = None if run.top_logprobs is None else _logprobs(run, rows, _emitted_rows(drafts, outputs, run.params.greedy))
    return outputs, info, grammar_s


def accepted(run: _Run, draft_list: list[int], outputs: tuple) -> tuple[int, int]:
    """(drafts accepted, next token) from a `verdict`'s evaluated outputs."""
    if run.params.greedy:
        return greedy_accept(draft_list, outputs[0].tolist())
    return int(outputs[0].item()), int(outputs[1].item())


def _candidates(proposal, k: int = 16) -> list[list[int]]:
    """The drafter's best ids per position, best first: v2's selector candidates, else the
    top-k of v1's logits."""
    if proposal.candidates is not None:
        return proposal.candidates[0].tolist()
    logits = proposal.logits[0]
    top = mx.argsort(-logits, axis=-1)[:, :k]
    return (top if proposal.vocab_ids is None else proposal.vocab_ids[top]).tolist()


def _emitted_rows(drafts: mx.array, outputs: tuple, greedy: bool) -> mx.array:
    """Per verify row j, the j-th emitted token (lazy; rows past the cycle's end are unused):
    the drafts while accepted, then the target's own pick."""
    if greedy:
        return outputs[0]  # accepted drafts equal the target's argmax, so its picks are the tokens
    n_acc, nxt = outputs
    idx = mx.arange(drafts.shape[0] + 1)
    padded = mx.concatenate([drafts, nxt.reshape(1).astype(drafts.dtype)])
    return mx.where(idx == n_acc, nxt.astype(drafts.dtype), padded)


def start_run(target, drafter, ids: list[int], max_tokens: int, width: int, params: SamplingParams,
              prompt_cache=None, *, kv_bits: int | None = None, kv_group_size: int | None = None,
              top_logprobs: int | None = None,
              overlap: bool = False, constraint: Constraint | None = None, prompt_len: int | None = None,
              lockstep=None):
    """A checked `_Run` for `ids` and what the caches already cover: (run, n_cached, mark).

    With `prompt_cache`, the caches are its own, brought to the longest prefix of `ids` they
    reach exactly, and `mark` is its `take_mark` when a snapshot before the prompt's last
    token pays (else None); `prompt_len` is the prompt's length when `ids` goes on past it
    (a reply continued). Without, fresh caches that roll back `width` tokens."""
    _check_args(target, drafter, ids, max_tokens, width)
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    n_cached, mark = 0, None
    if prompt_cache is not None:
        prompt_cache.check(target, drafter, width, kv_bits, kv_group_size)
        n_cached = prompt_cache.reuse(ids, prompt_len).n_cached
        target_cache, context = prompt_cache.target_cache, prompt_cache.context
        mark = prompt_cache.take_mark if prompt_cache.needs_mark else None
    else:
        target_cache = target.make_cache(reserve=max(width, 1), kv_bits=kv_bits, kv_group_size=kv_group_size)
        context = drafter.begin() if drafter is not None else None
    run = _Run(
        target=target, drafter=drafter, params=params, key=mx.random.key(seed), target_cache=target_cache,
        context=context, taps=tuple(drafter.config.target_layer_ids) if drafter is not None else (),
        history=list(ids), processors=make_processors(params), fed=n_cached, top_logprobs=top_logprobs,
        overlap=overlap, constraint=constraint, lockstep=lockstep,
    )
    return run, n_cached, mark


def _rank0_says(run: _Run, go: bool) -> bool:
    """Whether to run another prefill chunk. Sharded, rank 0's answer holds for every rank, so
    a cancel on rank 0 stops them all."""
    return _rank0_width(run, int(go)) > 0


def _rank0_width(run: _Run, width: int) -> int:
    """Rank 0's `width` on every rank, one int per step: the next cycle's width, or 0 when its
    row has ended (a stop string, a finished grammar, a close), which stops every rank."""
    if run.lockstep is None:
        return width
    width = int(run.lockstep.share(mx.array([width])).item())
    run.told_stop = width == 0
    return width


def _take(run: _Run, stopper: Stopper, emitted: list[int]) -> tuple[list[int], str | None]:
    """Emitted tokens into the reply: the stopper keeps what the client gets (and may finish),
    the history grows, the constraint advances (a completed grammar ends generation)."""
    kept, finish = stopper.feed(emitted)
    run.history.extend(emitted)
    if run.constraint is None:
        return kept, finish
    run.constraint.consume(emitted)
    return kept, finish or ("stop" if run.constraint.done else None)


def _can_pipeline(run: _Run) -> bool:
    """Whether a plain step may queue the next: penalties and grammars need each token on the
    host first, and sharded ranks must issue the same passes in the same order."""
    return not run.processors and run.constraint is None and run.lockstep is None


def _pick_width(run: _Run, width: int, left: int, block_policy) -> int:
    """The next cycle's width: 1 (plain) without a drafter, else the policy's or the cap."""
    cap = min(width, left)  # never draft past max_tokens
    if run.drafter is None and not run.follows:
        return 1
    return min(block_policy.next_width(cap), cap) if block_policy is not None else cap


def _next_cycle(run: _Run, width: int, left: int, block_policy: WidthPolicy | None, pipeline: bool):
    """Run the next cycle: a speculative step of the chosen width, or a plain step that, when
    pipelining, already picks (and for a plain one, queues) the cycle after it."""
    w = run.decided if run.decided is not None else _pick_width(run, width, left, block_policy)
    run.decided = None
    if w >= 2:
        emitted, cycle, logprobs = _step_speculative(run, w)
    else:
        ahead = (lambda: _pick_width(run, width, left - 1, block_policy)) if pipeline and left > 1 else None
        emitted, cycle, logprobs = _step_plain(run, ahead)
    if block_policy is not None:
        block_policy.observe(cycle)
    return emitted, cycle, logprobs
