"""Speculation across a batch: per-row drafts, one batched verify, per-row rollback.

Every greedy row equals its single-stream output while rows join, leave and keep different
prefixes of the same verify pass, for every cache kind (KV, sliding window, recurrent); seeded
rows at T > 0 equal their single-stream draws, and the batch's draws follow the target's
distribution.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from dflash2_mlx import generate
from dflash2_mlx.core import batch_cache, batch_engine, ragged
from dflash2_mlx.core.batch_engine import SpeculativeBatch
from dflash2_mlx.core.block_policy import BatchWidthPolicy, Costs, batch_costs
from dflash2_mlx.core.cache_kinds import kind_of
from dflash2_mlx.core.prompt_cache import PromptCache
from dflash2_mlx.core.sampling import SamplingParams
from dflash2_mlx.drafter.context import DraftContext
from dflash2_mlx.drafter.selector import Proposal
from dflash2_mlx.errors import ConfigError

from test_verify import ALPHA, E2E_PARAMS, E2E_PROMPT, _e2e_pvalue, _exact_joint
from tiny import VOCAB, drafter_config_dict, tiny_drafter, tiny_target

PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 30], [1, 61, 62, 63, 64],
           [1, 12, 13, 14, 15, 16, 17]]
LENGTHS = [40, 12, 25, 18, 30, 22]
FAMILIES = ["llama", "qwen3_5", "gemma3_text"]


def _run(batch, jobs, join_every=3, cancel=None):
    """Add `jobs` [(prompt, max_tokens, kwargs)] one every `join_every` steps; {index: tokens}."""
    ids, out, pending, steps = {}, {}, list(enumerate(jobs)), 0
    while len(batch) or pending:
        if pending and steps % join_every == 0:
            i, (prompt, n, kwargs) = pending.pop(0)
            ids[batch.add(prompt, n, **kwargs)] = i
        for rid, event in batch.step():
            out.setdefault(ids[rid], []).extend(event.tokens)
            if event.finish_reason is not None:
                out[ids[rid]].append(event.finish_reason)
        if cancel is not None and steps == cancel[1]:
            batch.remove(next(r for r, i in ids.items() if i == cancel[0]))
        steps += 1
    return out


class ScriptedRows:
    """A drafter that proposes each row's true continuation with one token corrupted per
    block, at a depth that cycles per row (offset by three times its index), so rows of one verify
    pass keep different prefixes and every depth occurs."""

    def __init__(self, target, truths, block_size):
        from dflash2_mlx.drafter.config import parse_config

        self.config = parse_config(drafter_config_dict("dflash", block_size=block_size, target_layers=(1,)))
        self.target, self.truths, self.rows = target, list(truths), 0
        self.accepted = []

    def begin(self, reserve=0):
        context = DraftContext([], None)
        context.truth, context.calls, context.seen = self.truths[self.rows], 3 * self.rows, 0
        self.rows += 1
        return context

    def draft(self, anchor, context, block_size, temperature=0.0, key=None):
        context.seen += context.take().shape[1]
        pos = context.seen  # the anchor's index in prompt + output
        drafts = list(context.truth[pos + 1 : pos + block_size]) + [3] * block_size
        drafts = drafts[: block_size - 1]
        bad = context.calls % (block_size + 1)
        if bad < block_size - 1:
            drafts[bad] = (drafts[bad] + 1) % VOCAB
        context.calls += 1
        return Proposal(tokens=mx.array([drafts], dtype=mx.int32))


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_joining_and_leaving_equal_their_single_stream_output(family, arch):
    target = tiny_target(family)
    drafter = tiny_drafter(target, arch, block_size=4)
    batch = SpeculativeBatch(target, drafter, prefill_step_size=4)  # prompts join over several steps
    jobs = [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)]
    out = _run(batch, jobs)
    for i, (p, n, _) in enumerate(jobs):
        assert out[i][:-1] == generate(target, p, n, drafter=drafter).tokens, i
    assert not batch.rows and batch_cache.batch_size(batch.cache) == 0


REPLAYS = {"per-layer": dict(stacked_replay=False), "generic": dict(fast_recurrent_replay=False)}


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_5-per-layer", "qwen3_5-generic"])
def test_rows_keeping_different_prefixes_of_one_verify_pass(family, monkeypatch):
    monkeypatch.setattr(ragged, "COMPACT_MIN_SLOTS", 8)  # pack holes often
    monkeypatch.setattr(batch_engine, "COMPACT_EVERY", 2)
    family, _, replay = family.partition("-")  # the recurrent replay's stacked path, its per-layer and generic twins
    target = tiny_target(family, **REPLAYS.get(replay, {}))
    plain = [generate(target, p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    drafter = ScriptedRows(target, [p + t + [3] * 20 for p, t in zip(PROMPTS, plain)], 5)
    accepted = []
    forward = target.commit_rows

    def spy(cache, n_fed, n_keep):
        accepted.append(list(n_keep))
        forward(cache, n_fed, n_keep)

    monkeypatch.setattr(target, "commit_rows", spy)
    out = _run(SpeculativeBatch(target, drafter, prefill_step_size=64), [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)],
               join_every=1)
    assert [out[i][:-1] for i in range(len(PROMPTS))] == plain
    assert {k for keep in accepted for k in keep} == set(range(1, 6))  # every depth, in some row
    assert sum(len(set(keep)) > 1 for keep in accepted) > 10  # rows of one pass kept different counts


def test_a_removed_row_leaves_the_others_exact():
    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    jobs = [(p, n, {}) for p, n in zip(PROMPTS[:4], LENGTHS[:4])]
    out = _run(SpeculativeBatch(target, drafter), jobs, join_every=1, cancel=(2, 5))
    assert out[2][-1] != "length" and len(out[2]) < LENGTHS[2]
    for i in (0, 1, 3):
        assert out[i][:-1] == generate(target, PROMPTS[i], LENGTHS[i], drafter=drafter).tokens


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_seeded_rows_draw_what_a_single_stream_draws(arch):
    target = tiny_target("gemma3_text")
    drafter = tiny_drafter(target, arch, block_size=4, top_k=8)
    sampling = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (3, 4, 5)]
    jobs = [(p, 20, {"sampling": s}) for p, s in zip(PROMPTS, sampling)]
    # A single stream's last cycles narrow to the tokens left; several rows share one width
    # (the batch cuts what a row cannot take), so the draws agree until the last block: 16 tokens.
    alone = [generate(target, p, 20, drafter=drafter, sampling=k["sampling"]).tokens for p, _, k in jobs]
    out = _run(SpeculativeBatch(target, drafter, block_size=4), jobs, join_every=1)
    assert [out[i][:16] for i in range(3)] == [a[:16] for a in alone]
    # a row decoding alone is the single stream, narrowing included
    solo = _run(SpeculativeBatch(target, drafter, block_size=4), jobs[:1])
    assert solo[0][:-1] == alone[0]
    assert alone[0] != generate(target, PROMPTS[0], 20, drafter=drafter,
                                sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=9)).tokens


@pytest.mark.slow
def test_batched_rows_emit_the_target_distribution():
    """960 seeded rows of 3 tokens, 48 to a batch: the first two and three tokens follow the
    target's exact joint (the single-stream engine's test, through the batch)."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=8)
    counts = {}
    for start in range(0, 960, 48):
        batch = SpeculativeBatch(target, drafter)
        jobs = [(E2E_PROMPT, 3, {"sampling": SamplingParams(seed=start + i, **E2E_PARAMS)}) for i in range(48)]
        for tokens in _run(batch, jobs, join_every=1).values():
            key = tuple(tokens[:-1])
            counts[key] = counts.get(key, 0) + 1
    joint = _exact_joint(target)
    assert _e2e_pvalue(counts, joint, 2) > ALPHA and _e2e_pvalue(counts, joint, 3) > ALPHA


def test_penalties_logprobs_and_stops_per_row():
    from dflash2_mlx import stream_generate

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    stop = generate(target, PROMPTS[2], 16, drafter=drafter).text[6:8]  # a stop string the reply meets
    kinds = [dict(sampling=SamplingParams(repetition_penalty=1.3)), dict(top_logprobs=2), dict(stop=[stop]), {}]
    batch = SpeculativeBatch(target, drafter)
    events = {}
    ids = {batch.add(p, 16, **k): i for i, (p, k) in enumerate(zip(PROMPTS, kinds))}
    while len(batch):
        for rid, e in batch.step():
            events.setdefault(ids[rid], []).append(e)
    for i, k in enumerate(kinds):
        alone = list(stream_generate(target, PROMPTS[i], 16, drafter=drafter, **k))
        assert [t for e in events[i] for t in e.tokens] == [t for e in alone for t in e.tokens]
        assert "".join(e.text for e in events[i]) == "".join(e.text for e in alone)
        if "top_logprobs" in k:  # every token's log-probability and alternatives, as the single stream's
            ours = [lp for e in events[i] for lp in e.logprobs]
            theirs = [lp for e in alone for lp in e.logprobs]
            assert [lp.token for lp in ours] == [lp.token for lp in theirs] and len(ours) == 16
            assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in ours] == [[t for t, _ in lp.top] for lp in theirs]
    assert events[2][-1].finish_reason == "stop" and events[2][-1].stop_sequence == stop
    assert len([t for e in events[2] for t in e.tokens]) < 16


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_caches_go_back_into_its_prompt_cache(family):
    """The next turn of a batched reply starts from the caches the batch handed back, and
    equals a cold run."""
    target = tiny_target(family)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    cache = PromptCache(target, drafter, reserve=8)
    batch = SpeculativeBatch(target, drafter)
    jobs = [(PROMPTS[0], 20, {"prompt_cache": cache}), (PROMPTS[1], 30, {})]
    reply = _run(batch, jobs, join_every=1)[0][:-1]
    assert cache.tokens[: len(PROMPTS[0]) + 19] == PROMPTS[0] + reply[:19]
    turn = PROMPTS[0] + reply + [44, 45]
    warm = generate(target, turn, 12, drafter=drafter, prompt_cache=cache)
    assert warm.cached_tokens >= len(PROMPTS[0]) + 10
    assert warm.tokens == generate(target, turn, 12, drafter=drafter).tokens


def test_ragged_cache_mask_matches_positions():
    cache = ragged.RaggedKVCache(window=3)
    kind_of(cache).add_rows(cache, [_kv(4), _kv(2)])
    cache.update_and_fetch(mx.zeros((2, 1, 2, 2)), mx.zeros((2, 1, 2, 2)))
    cache.commit(2, [2, 1])  # row 1 rejects its second token
    assert cache.lengths.tolist() == [6, 3]
    assert cache.pos[:, : cache.n_slots].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, -1, -1, 2, -1]]
    # The next query (row 0 at position 6, row 1 at 3) sees its window of 3, its own slot last.
    assert cache.make_mask(1)[:, 0, 0].tolist() == [[False, False, False, False, True, True, True],
                                                    [False, True, False, False, True, False, True]]
    row = cache.row_cache(1, reserve=4)
    assert (row.offset, row.n_stored, row.keys.shape[2]) == (3, 3, 3)


def _kv(n):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.update_and_fetch(mx.ones((1, 1, n, 2)), mx.ones((1, 1, n, 2)))
    return c


def test_bad_rows_fail_with_values():
    target = tiny_target("llama")
    batch = SpeculativeBatch(target, tiny_drafter(target, "dflash2", block_size=4))
    with pytest.raises(ConfigError, match="max_tokens must be >= 1, got 0"):
        batch.add([1, 2, 3], 0)
    with pytest.raises(ConfigError, match="the prompt is empty"):
        batch.add([], 4)
    with pytest.raises(ConfigError, match=r"prompt token ids \[500\] are outside the vocab \(size 97\)"):
        batch.add([1, 500], 4)
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        SpeculativeBatch(target, tiny_drafter(target, "dflash2"), block_size=1)


def test_batch_costs_and_the_width_policy_by_load():
    costs = Costs((0.05, 0.06, 0.07, 0.08), (0.0, 0.01, 0.01, 0.01))
    four = batch_costs(costs, 4)  # past width 4: the mean calibrated slope, 0.01 s per token
    assert four.target_s == pytest.approx((0.08, 0.08 + 4 * 0.01, 0.08 + 8 * 0.01, 0.08 + 12 * 0.01))
    assert four.draft_s == pytest.approx((0.0, 0.04, 0.04, 0.04))
    policy = BatchWidthPolicy(costs, probe_every=0)  # prior acceptance 0.6 per position
    assert policy.next_width(4, 1) == 3  # one row: 1.96 tokens for 1.6 plain steps
    assert policy.next_width(4, 4) == 1  # four rows: 1.6 tokens for 2 plain steps at best (width 2)
    assert policy.policy(4).acceptance is policy.policy(1).acceptance
    assert (policy.width, policy.batch) == (1, 4)
    policy.policy(4).plain_overhead_s = 0.02
    assert policy.policy(8).plain_overhead_s == pytest.approx(0.04)  # from the nearest size, per row
    policy.next_width(4, 8)
    assert policy.policy(8).spec_overhead_s == pytest.approx(0.04)  # unseen: at least a plain cycle's
    for _ in range(40):  # drafts that never land turn one row's speculation off too
        policy.observe(1, SimpleNamespace(width=4, n_drafted=3, n_accepted=0, draft_s=0.01, verify_s=0.07),
                       [(3, 0)])
    assert policy.next_width(4, 1) == 1
    reached = policy.acceptance.reached[0]
    policy.begin()  # a new reply: the shared evidence fades once, each batch size probes next
    assert policy.acceptance.reached[0] == pytest.approx(reached * 0.5)
    assert all(p.probe_next is False for p in policy.by_batch.values())  # probe_every=0: never


def test_a_new_row_begins_the_batch_policy():
    target = tiny_target("llama")
    begun = []
    policy = BatchWidthPolicy(Costs((0.05, 0.06, 0.07, 0.08), (0.0, 0.01, 0.01, 0.01)))
    policy.begin = lambda: begun.append(1)
    batch = SpeculativeBatch(target, tiny_drafter(target, "dflash2", block_size=4), policy=policy)
    batch.add(PROMPTS[0], 8)
    batch.add(PROMPTS[1], 8)
    assert begun == [1, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_rows_equal_their_constrained_single_stream_output(family):
    pytest.importorskip("llguidance")
    from dflash2_mlx.core.constraint import GrammarConstraint, json_schema_grammar

    target = tiny_target(family, byte_level=True)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                   "required": ["a", "b"]})

    def constraint():
        return GrammarConstraint(target.tokenizer, target.info.vocab_size, target.eos_token_ids, grammar)

    jobs = [([1, 5, 6, 7], 40, {"constraint": constraint()}), (PROMPTS[0], 30, {}),
            ([1, 9, 8], 40, {"constraint": constraint()})]
    out = _run(SpeculativeBatch(target, drafter), jobs, join_every=1)
    for i, (p, n, k) in enumerate(jobs):
        alone = generate(target, p, n, drafter=drafter, **({"constraint": constraint()} if k else {}))
        assert out[i][:-1] == alone.tokens, i
    assert out[0][:-1] != generate(target, [1, 5, 6, 7], 40, drafter=drafter).tokens  # the grammar mattered


def test_one_argmax_for_the_batch_equals_each_rows_own_pick():
    """The fast path of plain batched steps (one argmax over the batch) against its slow twin."""
    target = tiny_target("qwen3_5")
    jobs = [(p, n, {}) for p, n in zip(PROMPTS, LENGTHS)]
    fast = _run(SpeculativeBatch(target, None, fast_greedy=True), jobs)
    slow = _run(SpeculativeBatch(target, None, fast_greedy=False), jobs)
    assert fast == slow
    assert [fast[i][:-1] for i in range(len(jobs))] == [generate(target, p, n).tokens for p, n, _ in jobs]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_row_leaving_the_batch_keeps_only_its_own_buffers(family):
    import gc

    target = tiny_target(family)
    rows = []
    for k in range(8):  # prefilled single rows, as the batch receives them
        cache = target.make_cache(reserve=1)
        target.forward(mx.array([[1] + [(k + j) % 90 + 3 for j in range(300)]]), cache, (), "none")
        mx.eval([c.state for c in cache])
        rows.append(cache)
    batch = batch_cache.empty_batch(target)
    batch_cache.add_rows(batch, rows)
    mx.eval([c.state for c in batch])
    del rows
    gc.collect()
    row = batch_cache.row_cache(batch, 3, reserve=4)
    row_bytes = sum(batch_cache_bytes(c) for c in row)
    before = mx.get_active_memory()
    batch_bytes = sum(batch_cache_bytes(c) for c in batch)
    del batch
    gc.collect()
    freed = before - mx.get_active_memory()
    # everything but the row itself goes: nothing of the batch stays behind a view or a lazy gather
    assert freed >= batch_bytes - 2 * row_bytes, (freed, batch_bytes, row_bytes)


def batch_cache_bytes(c) -> int:
    state = c.state
    arrays = state if isinstance(state, (list, tuple)) else [state]
    return sum(a.nbytes for a in arrays if isinstance(a, mx.array))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_cancelled_row_keeps_its_conversation_cache(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    cache = PromptCache(target, drafter, reserve=4)
    batch = SpeculativeBatch(target, drafter)
    rid = batch.add(PROMPTS[0], 40, prompt_cache=cache)
    batch.add(PROMPTS[1], 40)
    reply = []
    for _ in range(6):
        for r, event in batch.step():
            if r == rid:
                reply += event.tokens
    batch.remove(rid)  # cancelled mid-reply, between steps
    assert len(reply) > 4 and cache.tokens == (PROMPTS[0] + reply)[: len(cache.tokens)]
    assert len(cache.tokens) >= len(PROMPTS[0]) + len(reply) - 1
    turn = PROMPTS[0] + reply + [44, 45]
    warm = generate(target, turn, 12, drafter=drafter, prompt_cache=cache)
    assert warm.cached_tokens >= len(PROMPTS[0]) + len(reply) - 4
    assert warm.tokens == generate(target, turn, 12, drafter=drafter).tokens


class FailingConstraint:
    """A grammar that accepts everything and then breaks at its `fail_at`-th commit, as a
    grammar engine failing inside one request would."""

    mask_drafts = False
    done = False

    def __init__(self, fail_at: int):
        self.consumed, self.fail_at = 0, fail_at

    def apply(self, rows, drafts, allowed=None):
        return rows

    def consume(self, tokens):
        self.consumed += 1
        if self.consumed == self.fail_at:
            raise ConfigError(f"grammar broke at cycle {self.consumed}")


@pytest.mark.parametrize("arch", [None, "dflash2"])
def test_one_rows_error_leaves_the_other_rows_decoding(arch):
    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, arch, block_size=4) if arch else None
    batch = SpeculativeBatch(target, drafter)
    ok_a = batch.add(PROMPTS[0], 30)
    bad = batch.add(PROMPTS[1], 30, constraint=FailingConstraint(4))
    ok_b = batch.add(PROMPTS[2], 30)
    out, failures = {}, []
    while len(batch):
        for rid, event in batch.step():
            out.setdefault(rid, []).extend(event.tokens)
        failures += batch.take_failures()
    assert [(rid, str(e)) for rid, e in failures] == [(bad, "grammar broke at cycle 4")]
    for rid, prompt in ((ok_a, PROMPTS[0]), (ok_b, PROMPTS[2])):
        assert out[rid] == generate(target, prompt, 30, drafter=drafter).tokens


def test_packing_a_window_batch_keeps_spare_slots_so_a_leaving_row_can_trim():
    from dflash2_mlx.core.cache_kinds import can_trim

    cache = ragged.RaggedKVCache(window=8)
    kind_of(cache).add_rows(cache, [_kv(150), _kv(120)])
    assert cache.compact()  # most slots sit outside the window
    row = cache.row_cache(0, reserve=ragged.WINDOW_SPARE)
    assert row.offset == 150 and row.n_stored == 8 - 1 + ragged.WINDOW_SPARE
    assert can_trim(row, ragged.WINDOW_SPARE)  # a next turn that diverges that far back trims exactly
    assert cache.n_slots < 150  # and the packing still frees the rest


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", [None, "dflash2"])
def test_a_row_alone_runs_on_native_caches_and_turns_ragged_and_back(family, arch):
    """One decoder: a row alone is the single stream (its caches, its cycles: plain steps
    pipelined, widths narrowed at the end); a second row makes both ragged rows; the one
    left turns native again. Every row equals its single-stream output."""
    target = tiny_target(family)
    drafter = tiny_drafter(target, arch, block_size=4) if arch else None
    batch = SpeculativeBatch(target, drafter)
    first = batch.add(PROMPTS[0], 40)
    out, states = {first: []}, []
    for _ in range(6):
        for rid, ev in batch.step():
            out[rid] += ev.tokens
    assert batch.alone and batch_cache.batch_size(batch.cache) == 0
    second = batch.add(PROMPTS[1], 12)
    out[second] = []
    while len(batch):
        for rid, ev in batch.step():
            out[rid] += ev.tokens
        states.append((len(batch.rows), batch.alone, batch_cache.batch_size(batch.cache)))
    assert (2, False, 2) in states  # decoded together on ragged caches ...
    assert states[-2][:2] == (1, True)  # ... and the first finished alone again, on native caches
    for rid, prompt, n in ((first, PROMPTS[0], 40), (second, PROMPTS[1], 12)):
        assert out[rid] == generate(target, prompt, n, drafter=drafter).tokens


def test_batched_cycles_draft_no_further_than_the_rows_limits():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=6)
    batch = SpeculativeBatch(target, drafter)
    rows = {batch.add(PROMPTS[0], 4): 4, batch.add(PROMPTS[1], 3): 3}
    made, widths = dict.fromkeys(rows, 0), []
    while len(batch):
        events = batch.step()
        for rid, ev in events:  # a first token comes before any cycle of its row
            made[rid] += len(ev.tokens) if ev.cycle is None else 0
        left = max(rows[r] - made[r] for r in rows)
        for rid, ev in events:
            if ev.cycle is not None:
                made[rid] += len(ev.tokens)
                widths.append((ev.cycle.width, left))
    assert widths and all(w <= left for w, left in widths)  # the batched cycle is capped, not width 6
    assert made == rows


def test_a_rows_first_token_comes_in_a_step_of_its_own():
    """A prefilled row decodes from the next step: its first token reaches the client (and a
    cancel can stop it) before any cycle of its own runs, alone or joining a decoding row."""
    target = tiny_target("llama")
    batch = SpeculativeBatch(target, tiny_drafter(target, "dflash2", block_size=4))
    rid = batch.add(PROMPTS[0], 20)
    assert [(r, ev.cycle) for r, ev in batch.step()] == [(rid, None)]
    assert [r for r, ev in batch.step() if ev.cycle is not None] == [rid]
    other = batch.add(PROMPTS[1], 20)
    events = batch.step()
    assert [(r, ev.cycle is None) for r, ev in events] == [(other, True), (rid, False)]
    assert {r for r, ev in batch.step() if ev.cycle is not None} == {rid, other}


def test_stream_generate_is_the_decoder_of_one_row():
    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    ref = generate(target, PROMPTS[2], 25, drafter=drafter)
    batch = SpeculativeBatch(target, drafter)
    batch.add(PROMPTS[2], 25)
    tokens, widths = [], []
    while len(batch):
        for _, ev in batch.step():
            tokens += ev.tokens
            widths += [ev.cycle.width] if ev.cycle is not None else []
    assert tokens == ref.tokens and widths == [c.width for c in ref.cycles]


def test_a_row_alone_hands_its_native_caches_to_its_prompt_cache():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    pc = PromptCache(target, drafter, reserve=4)
    batch = SpeculativeBatch(target, drafter)
    batch.add(PROMPTS[0], 10, prompt_cache=pc)
    reply = []
    while len(batch):
        for _, ev in batch.step():
            reply += ev.tokens
    assert pc.tokens == (PROMPTS[0] + reply)[: len(pc.tokens)] and len(pc.tokens) >= len(PROMPTS[0]) + 9
    turn, n_before = PROMPTS[0] + reply + [5, 6], len(pc.tokens)
    again = SpeculativeBatch(target, drafter)
    again.add(turn, 8, prompt_cache=pc)
    cont = []
    while len(again):
        for _, ev in again.step():
            cont += ev.tokens
            assert ev.cached_tokens == n_before  # the first turn's caches, reused
    assert cont == generate(target, turn, 8, drafter=drafter).tokens


def test_the_batch_holds_the_wired_limit_while_it_has_rows(monkeypatch):
    from contextlib import contextmanager

    log = []

    @contextmanager
    def wired(model):
        log.append("enter")
        yield
        log.append("exit")

    monkeypatch.setattr(batch_engine, "_wired_limit", wired)
    target = tiny_target("llama")
    batch = SpeculativeBatch(target, tiny_drafter(target, "dflash2", block_size=4))
    _run(batch, [(PROMPTS[0], 12, {}), (PROMPTS[1], 20, {})], join_every=2)
    assert log == ["enter", "exit"]  # once for the whole busy spell, released when the last row ended
    rid = batch.add(PROMPTS[2], 8)
    batch.step()
    assert log == ["enter", "exit", "enter"]
    batch.remove(rid)
    assert log == ["enter", "exit", "enter", "exit"] and not len(batch)
