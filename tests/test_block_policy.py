"""Block policy: expected-rate arithmetic, width choice on synthetic curves, the online policy
in a simulated environment (right width, no flapping, never speculating when it loses), the
calibration cache, and `auto_policy` on a tiny pair through the real engine."""

import json
import random

import pytest

from dflash2_mlx.core import block_policy as bp
from dflash2_mlx.core.block_policy import (
    AcceptanceEstimate,
    AdaptiveBlockPolicy,
    Calibration,
    Costs,
    FixedBlockPolicy,
    choose_width,
    expected_rates,
    expected_tokens,
)
from dflash2_mlx.core.events import CycleStats


def linear_costs(max_width, per_token, draft_s, plain_s=1.0):
    """Target forward of width w costs plain_s + per_token*(w-1); the drafter a flat draft_s."""
    return Costs(tuple(plain_s + per_token * (w - 1) for w in range(1, max_width + 1)),
                 tuple(0.0 if w == 1 else draft_s for w in range(1, max_width + 1)))


def test_expected_tokens_by_hand():
    assert expected_tokens([0.5, 0.5], 1) == 1.0
    assert expected_tokens([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 7, 8) == 8.0
    assert expected_tokens([0.9, 0.0, 1.0], 4) == pytest.approx(1.9)
    assert expected_tokens([0.5], 3) == pytest.approx(1.75)  # the last rate extends


@pytest.mark.parametrize("acceptance, costs, best", [
    # cheap verify, steady 0.8 acceptance: 1.95, 2.19, 2.32, 2.38, 2.395 (w=7), 2.378 ... tok/s
    ([0.8] * 15, linear_costs(16, 0.1, 0.05), 7),
    # acceptance collapses after position 2: width 4 (2.709) beats 3 (2.606) and 5 (2.689)
    ([0.9, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2], linear_costs(8, 0.02, 0.0), 4),
    # perfect drafts and a flat cost: the widest block
    ([1.0] * 7, linear_costs(8, 0.0, 0.01), 8),
])
def test_choose_width_picks_the_fastest(acceptance, costs, best):
    choice = choose_width(expected_rates(costs, acceptance, costs.max_width))
    assert choice.width == best
    assert choice.speculate and choice.predicted_speedup > 1


@pytest.mark.parametrize("acceptance, costs", [
    # verify cost linear in width (MLX's bundled CPU BLAS): even 0.9 acceptance loses
    ([0.9] * 15, linear_costs(16, 1.0, 0.2)),
    # poor drafts: width 2 yields 1.3 tokens for 1.35x the time
    ([0.3] * 7, linear_costs(8, 0.25, 0.1)),
])
def test_choose_width_never_speculates_when_it_loses(acceptance, costs):
    rates = expected_rates(costs, acceptance, costs.max_width)
    assert max(rates[1:]) < rates[0]
    for current in (None, 1, 2, 5):
        assert choose_width(rates, current).width == 1


def test_hysteresis_keeps_the_current_width_and_leaves_losing_speculation_at_once():
    rates = [1.0, 1.5, 1.52, 1.3]
    assert choose_width(rates).width == 3
    assert choose_width(rates, current=2).width == 2  # 3 is only 1.3% faster
    assert choose_width([1.0, 1.5, 1.7, 1.3], current=2).width == 3
    assert choose_width([1.0, 1.03, 0.9], current=1).width == 1  # 3% is inside the margin
    assert choose_width([1.0, 0.99, 0.9], current=2).width == 1  # losing: leave at once
    assert choose_width([1.0, 0.95, 1.03], current=2).width == 1  # ...and re-enter only past the margin


def test_nondecreasing_fit():
    assert bp.nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert bp.nondecreasing([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert bp.nondecreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert bp.nondecreasing([]) == []


def test_break_even_acceptance():
    costs = linear_costs(4, 0.5, 0.0)  # width 2 costs 1.5 plain steps: needs 1 + a = 1.5
    assert bp.break_even_acceptance(costs, 2) == pytest.approx(0.5)
    assert bp.break_even_acceptance(costs, 3) == pytest.approx(0.6180340, abs=1e-6)  # 1 + a + a^2 = 2
    assert bp.break_even_acceptance(linear_costs(4, 1.0, 0.1), 3) is None


def test_acceptance_estimate_counts_and_inheritance():
    est = AcceptanceEstimate(4, prior=0.5, prior_weight=1.0, decay=1.0)
    est.observe(n_drafted=3, n_accepted=1)  # pos 1 accepted, pos 2 rejected, pos 3 unreached
    est.observe(n_drafted=3, n_accepted=3)
    assert est.reached == [2.0, 2.0, 1.0, 0.0]
    assert est.accepted == [2.0, 1.0, 1.0, 0.0]
    r = est.rates()
    assert r[0] == pytest.approx((2 + 0.5) / 3)
    assert r[1] == pytest.approx((1 + r[0]) / 3)
    assert r[2] == pytest.approx((1 + r[1]) / 2)
    assert r[3] == pytest.approx(r[2])  # never reached: inherits its predecessor


def simulate(policy, true_acceptance, costs, n_cycles, max_width, seed=0, spec_extra_s=0.0, plain_extra_s=0.0):
    """Drive a policy with cycles whose acceptance is drawn from `true_acceptance` and whose
    times are the calibrated costs (plus `spec_extra_s` per speculative cycle, a number or a
    function of the width, and `plain_extra_s` per plain step: a context longer than the
    calibration's)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    spec_extra = spec_extra_s if callable(spec_extra_s) else (lambda w: spec_extra_s)
    for _ in range(n_cycles):
        w = policy.next_width(max_width)
        n_acc = 0
        while n_acc < w - 1 and rng.random() < true_acceptance[n_acc]:
            n_acc += 1
        t = costs.cycle_s(w) + (spec_extra(w) if w > 1 else plain_extra_s)
        policy.observe(CycleStats(w, w - 1, n_acc if w > 1 else 0, n_acc + 1, costs.draft_s[w - 1],
                                  t - costs.draft_s[w - 1]))
        tokens += n_acc + 1
        seconds += t
    return tokens / seconds


def test_policy_converges_to_the_best_width_without_flapping():
    costs = linear_costs(16, 0.1, 0.05)
    truth = [0.8] * 15
    policy = AdaptiveBlockPolicy(costs, prior=0.5)
    simulate(policy, truth, costs, 200, 16, seed=1)
    late = policy.trace.widths[-100:]
    true_rates = expected_rates(costs, truth, 16)
    assert all(true_rates[w - 1] >= 0.97 * max(true_rates) for w in late)
    assert len({w for w in late}) <= 2
    assert sum(a != b for a, b in zip(late, late[1:])) <= 2
    fixed_best = simulate(FixedBlockPolicy(7), truth, costs, 400, 16, seed=2)
    assert simulate(policy, truth, costs, 400, 16, seed=2) >= 0.93 * fixed_best


def test_policy_stays_plain_when_speculation_cannot_win():
    costs = linear_costs(8, 1.0, 0.2)  # even perfect drafts lose
    policy = AdaptiveBlockPolicy(costs, prior=0.99)
    rate = simulate(policy, [1.0] * 7, costs, 300, 8)
    assert set(policy.trace.widths) == {1} and policy.trace.n_probes == 0
    assert rate == pytest.approx(1.0)


def test_policy_turns_speculation_off_when_drafts_are_poor_and_only_probes():
    costs = linear_costs(8, 0.15, 0.05)  # wins at good acceptance, loses at 0.15
    truth = [0.15] * 7
    assert max(expected_rates(costs, truth, 8)[1:]) < 1.0
    policy = AdaptiveBlockPolicy(costs, prior=0.8, probe_every=32)
    rate = simulate(policy, truth, costs, 640, 8, seed=3)
    late = policy.trace.widths[100:]
    assert sum(w > 1 for w in late) <= policy.trace.n_probes <= 6  # failed probes back off: gaps 32, 64, ...
    assert rate >= 0.98  # plain decoding runs at 1.0 tok/s here


def test_probes_bring_speculation_back_when_drafts_improve():
    costs = linear_costs(8, 0.15, 0.05)
    policy = AdaptiveBlockPolicy(costs, prior=0.8, probe_every=32)
    simulate(policy, [0.15] * 7, costs, 200, 8, seed=5)
    assert set(policy.trace.widths[-100:]) <= {1, *range(2, 9)} and policy.current == 1
    simulate(policy, [0.95] * 7, costs, 300, 8, seed=6)  # the text turned predictable
    assert policy.current is not None and policy.current >= 4
    assert sum(w >= 4 for w in policy.trace.widths[-100:]) >= 95


def test_a_new_reply_probes_at_once_instead_of_inheriting_the_last_ones_probe_gap():
    """The bench's MBPP replies decoded plainly end to end after a HumanEval reply with poor
    drafts had pushed the probe gap up; a new reply's text is new evidence."""
    costs = linear_costs(8, 0.15, 0.05)
    policy, twin = (AdaptiveBlockPolicy(costs, prior=0.8, probe_every=32) for _ in range(2))
    for p in (policy, twin):
        simulate(p, [0.15] * 7, costs, 400, 8, seed=5)
        assert p.current == 1 and p.probe_gap >= 64
    reached = policy.acceptance.reached[0]
    policy.begin()
    assert policy.acceptance.reached[0] == pytest.approx(reached * bp.REPLY_FADE)
    assert policy.probe_gap == 32
    simulate(policy, [0.95] * 7, costs, 40, 8, seed=6)  # the next reply's text is predictable
    simulate(twin, [0.95] * 7, costs, 40, 8, seed=6)
    assert policy.trace.widths[400] > 1  # its first step probes
    assert sum(w >= 4 for w in policy.trace.widths[400:]) >= 30
    assert set(twin.trace.widths[400:]) == {1}  # without begin: still waiting for the gap


def test_begin_never_probes_where_probing_is_off_or_cannot_win():
    off = AdaptiveBlockPolicy(linear_costs(8, 0.15, 0.05), prior=0.1, probe_every=0)
    off.begin()
    assert off.next_width(8) == 1 and off.trace.n_probes == 0
    costs = linear_costs(8, 1.0, 0.2)  # even perfect drafts lose
    never = AdaptiveBlockPolicy(costs, prior=0.99)
    never.begin()
    assert never.next_width(8) == 1 and never.trace.n_probes == 0


def test_a_cycle_after_plain_steps_learns_its_verify_but_not_the_drafters_catch_up():
    """The first draft after plain steps also feeds the drafter every row since its last draft
    (0.1 s after an 8k prompt on the demo): that is not what the next cycle will cost, its
    verify is."""
    costs = linear_costs(4, 0.1, 0.3)
    policy = AdaptiveBlockPolicy(costs, probe_every=0)
    policy.observe(CycleStats(1, 0, 0, 1, 0.0, 1.0))
    policy.probing = True  # weigh the cycle fully, as a probe is
    policy.observe(CycleStats(2, 1, 0, 1, 5.0, costs.target_s[1] + 2.0))
    assert policy.spec_overhead_s * costs.growth(2) == pytest.approx(2.0)


def test_one_accepted_draft_in_a_probe_weakens_old_evidence_and_two_replace_it():
    costs = linear_costs(4, 0.1, 0.05)
    for accepted, kept in ((1, bp.REPLY_FADE), (2, 0.0)):
        policy = AdaptiveBlockPolicy(costs, prior=0.6)
        for _ in range(20):
            policy.acceptance.observe(3, 0)
        before = policy.acceptance.reached[0]
        policy.probing = True
        policy.observe(CycleStats(accepted + 1, accepted, accepted, accepted + 1, 0.05, costs.target_s[accepted]))
        assert policy.acceptance.reached[0] == pytest.approx(before * kept * bp.DEFAULT_DECAY + 1)


def test_policy_learns_overheads_it_was_not_calibrated_for():
    costs = linear_costs(8, 0.05, 0.05)
    truth = [0.6] * 7
    assert max(expected_rates(costs, truth, 8)[1:]) > 1.2  # calibration says: speculate
    policy = AdaptiveBlockPolicy(costs, prior=0.6, probe_every=0)
    simulate(policy, truth, costs, 300, 8, seed=4, spec_extra_s=1.5)  # but every cycle costs 1.5 s more
    assert policy.spec_overhead_s > 0.5
    assert set(policy.trace.widths[-250:]) == {1}


# How much faster each width's forward grows with the context than a plain step's: the demo
# target at 8k tokens on a 2-core CPU (each verified row attends on its own there).
CPU_GROWTH = (1.0, 1.5, 1.85, 2.2, 2.55, 2.9, 3.2, 3.5)


def long_context_reply_ratios(costs, seed):
    """`auto` against plain decoding over three 64-token replies at a context where a plain step
    costs 6x its calibrated time and a width-w cycle's extra grows by CPU_GROWTH[w - 1], with
    a per-position acceptance of 0.35 (speculation loses there)."""
    policy = AdaptiveBlockPolicy(costs, prior=0.6)
    policy.begin()
    simulate(policy, [0.1] * 7, costs, 40, 8, seed=seed)  # a warm-up reply: poor drafts, plain
    plain_rate = 1 / (costs.cycle_s(1) + 5.0)
    ratios = []
    for reply in range(3):
        policy.begin()
        rate = simulate(policy, [0.35] * 7, costs, 64, 8, seed=seed + reply, plain_extra_s=5.0,
                        spec_extra_s=lambda w: 5.0 * CPU_GROWTH[w - 1])
        ratios.append(rate / plain_rate)
    return ratios, policy


@pytest.mark.parametrize("seed", range(4))
def test_a_long_context_where_speculation_loses_costs_a_few_percent(seed):
    """At 8k tokens of 8-bit K/V on a CPU a plain step costs ~6x its calibrated time and a
    width-4 verify ~1.9 plain steps; there the demo's `auto` once probed 4-5 times per 64-token
    reply and ran at 0.84-0.93x plain. Probes learn the cost at once, their measured loss spaces
    the next, and the calibrated growth by width steers them to the narrow widths that cost least."""
    base = linear_costs(8, 0.1, 0.3)
    measured = Costs(base.target_s, base.draft_s, tuple(1e-3 * g for g in CPU_GROWTH))
    ratios, policy = long_context_reply_ratios(measured, seed)
    assert min(ratios) >= 0.97 and sum(ratios) / 3 >= 0.98, ratios
    late = policy.trace.widths[40:]
    assert sum(w >= 4 for w in late) <= 2, late  # wide cycles cost 2.2+ plain steps here: probes stay narrow


def test_at_long_context_the_measured_growth_keeps_blocks_narrow():
    """Where speculation pays at long context on a CPU (acceptance 0.8), each verified row pays the
    context again: the best width is 3-5, not the widest. With the measured growth the policy
    settles there; with growth guessed from the short context's cost ratio it goes wider and loses."""
    base = linear_costs(8, 0.1, 0.3)
    measured = Costs(base.target_s, base.draft_s, tuple(1e-3 * g for g in CPU_GROWTH))
    truth, extra = [0.8] * 7, (lambda w: 5.0 * CPU_GROWTH[w - 1])
    rates = {}
    for name, costs in (("measured", measured), ("unmeasured", base)):
        for seed in range(3):
            policy = AdaptiveBlockPolicy(costs, prior=0.6)
            rates[name, seed] = simulate(policy, truth, costs, 300, 8, seed=seed, plain_extra_s=5.0, spec_extra_s=extra)
            late = policy.trace.widths[-100:]
            if name == "measured":
                assert max(set(late), key=late.count) <= 5, late
    assert sum(rates["measured", s] for s in range(3)) > 1.02 * sum(rates["unmeasured", s] for s in range(3)), rates


def test_growth_comes_from_the_slopes_and_stays_within_one_and_the_width():
    base = linear_costs(4, 0.1, 0.3)
    assert [base.growth(w) for w in (1, 2, 4)] == pytest.approx([1.0, 1.1, 1.3])  # no slopes: cost ratio
    slopes = Costs(base.target_s, base.draft_s, (1e-3, 1.5e-3, 3e-3, 9e-3))
    assert [slopes.growth(w) for w in (1, 2, 3, 4)] == pytest.approx([1.0, 1.5, 3.0, 4.0])  # 9x: capped at 4
    flat = Costs(base.target_s, base.draft_s, (0.0, 0.0, 1e-9, 1e-9))  # a GPU: no measurable slope
    assert [flat.growth(w) for w in (2, 4)] == pytest.approx([1.1, 1.3])
    with pytest.raises(ValueError, match="slope_s must be empty or 4 non-negative"):
        Costs(base.target_s, base.draft_s, (1e-3, -1e-3, 0.0, 0.0))


def test_speculation_into_a_much_longer_context_turns_off_within_a_few_cycles():
    """Speculating from a short context into a long one: plain steps are not observed, so the
    speculative cycles' own cost must be followed fast, not by 10 % per cycle."""
    costs = linear_costs(8, 0.1, 0.3)
    policy = AdaptiveBlockPolicy(costs, prior=0.6)
    simulate(policy, [0.9] * 7, costs, 64, 8, seed=1)
    assert policy.current >= 4  # speculation pays at the calibrated context
    policy.begin()
    simulate(policy, [0.5] * 7, costs, 64, 8, seed=2, plain_extra_s=5.0, spec_extra_s=40.0)
    first_plain = policy.trace.widths[64:].index(1)
    assert first_plain <= 6, policy.trace.widths[64:80]


def test_calibration_cache_roundtrip_and_info(tmp_path):
    base = linear_costs(4, 0.1, 0.05)
    cal = Calibration(key="abc", costs=Costs(base.target_s, base.draft_s, (1e-4, 2e-4, 3e-4, 4e-4)),
                      machine={"summary": "test box"}, model={"target": {"path": "/m/t"}, "drafter": {"path": "/m/d"}},
                      slope_context=2048)
    path = bp.save_calibration(cal, tmp_path)
    assert path == tmp_path / "abc.json"
    back = bp.load_calibration("abc", tmp_path)
    assert back.costs == cal.costs and back.machine == cal.machine and back.slope_context == 2048
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "old.json").write_text(json.dumps({**cal.to_dict(), "schema": 0}))
    assert bp.load_calibration("broken", tmp_path) is None and bp.load_calibration("old", tmp_path) is None
    info = bp.calibration_info(tmp_path)
    assert len(info) == 1
    assert info[0]["target"] == "/m/t" and info[0]["machine"] == "test box" and info[0]["max_width"] == 4
    assert info[0]["speculation_can_win"] is True
    assert info[0]["cost_ratio_by_width"][0] == 1.0
    assert info[0]["context_growth_by_width"] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert bp.calibration_info(tmp_path / "missing") == []
    cal.model["drafter"] = {"path": None, "arch": "dflash2", "n_layers": 2, "hidden_size": 64, "block_size": 8}
    bp.save_calibration(cal, tmp_path)
    assert bp.calibration_info(tmp_path)[0]["drafter"] == "dflash2 drafter (2 layers, hidden 64, block 8)"


def test_costs_reject_bad_values():
    with pytest.raises(ValueError, match="equal length"):
        Costs((1.0, 2.0), (0.0,))
    with pytest.raises(ValueError, match="positive"):
        Costs((0.0, 1.0), (0.0, 0.0))


def test_auto_policy_measures_once_then_uses_the_cache(tmp_path, monkeypatch):
    from dflash2_mlx import generate
    from dflash2_mlx.core import calibration

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=6)
    policy = calibration.auto_policy(target, drafter, cache_dir=tmp_path)
    assert policy.costs.max_width == 6 and len(list(tmp_path.glob("*.json"))) == 1
    assert all(s > 0 for s in policy.costs.target_s) and policy.costs.draft_s[0] == 0.0
    slope = policy.costs.slope_s  # measured again after DEFAULT_SLOPE_CONTEXT tokens
    assert len(slope) == 6 and all(b >= a >= 0 for a, b in zip(slope, slope[1:]))

    def no_measuring(*args, **kwargs):
        raise AssertionError("calibration should come from the cache")

    monkeypatch.setattr(calibration, "calibrate", no_measuring)
    again = calibration.auto_policy(target, drafter, cache_dir=tmp_path)
    assert again.costs == policy.costs
    prompt = [1, 40, 41, 42, 7, 19]
    plain = generate(target, prompt, max_tokens=40).tokens
    result = generate(target, prompt, drafter=drafter, max_tokens=40, block_size=6, block_policy=again)
    assert result.tokens == plain
    assert [c.width for c in result.cycles] == again.trace.widths[: len(result.cycles)]


def test_fixed_policy_is_the_engine_without_a_policy():
    from dflash2_mlx import generate

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "dflash", block_size=5)
    prompt = [1, 9, 8, 7, 6]
    a = generate(target, prompt, drafter=drafter, max_tokens=30, block_size=5)
    b = generate(target, prompt, drafter=drafter, max_tokens=30, block_size=5, block_policy=FixedBlockPolicy(5))
    assert a.tokens == b.tokens
    assert [(c.width, c.n_accepted) for c in a.cycles] == [(c.width, c.n_accepted) for c in b.cycles]


def test_session_prepare_calibrates_before_the_first_generation(isolated, monkeypatch):
    from dflash2_mlx.core import calibration
    from dflash2_mlx.session import Session

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    assert Session(spec=None, target=target, drafter=drafter, block_size=4).prepare() is None
    session = Session(spec=None, target=target, drafter=drafter, block_size="auto")
    line = session.prepare()
    assert line.startswith("block size auto: calibration ready in") and "width 2..4" in line
    policy = session._policy
    assert policy is not None and session.prepare() is None  # once

    def no_new_policy(*args, **kwargs):
        raise AssertionError("generation must reuse the prepared policy")

    monkeypatch.setattr(calibration, "auto_policy", no_new_policy)
    session.generate([1, 40, 41, 42], max_tokens=8)
    assert session._policy is policy and policy.trace.widths


def test_a_seeded_sampled_request_repeats_under_auto(isolated):
    from dflash2_mlx import SamplingParams
    from dflash2_mlx.session import Session

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    session = Session(spec=None, target=target, drafter=drafter, block_size="auto")
    session.prepare()
    seeded = SamplingParams(temperature=0.8, seed=11)
    first = session.generate([1, 40, 41, 42], sampling=seeded, max_tokens=30)
    for w in (2, 3, 4):  # the policy keeps learning from other requests in between
        session._policy.observe(CycleStats(w, w - 1, 0, 1, 0.001, 0.05 * w))
        session.generate([1, 9, 8, 7], max_tokens=10)
    again = session.generate([1, 40, 41, 42], sampling=seeded, max_tokens=30)
    assert again.tokens == first.tokens
    widths = [c.width for c in first.cycles]
    assert set(widths[:-3]) == {4}  # the trained width, not the policy's (the last ones are cut by max_tokens)


@pytest.mark.parametrize("block_size, drafted, width, adaptive", [
    ("auto", True, 4, True), (None, True, 4, False), (3, True, 3, False), ("6", True, 6, False),
    ("auto", False, 1, False), (None, False, 1, False)])
def test_a_session_resolves_its_block_size_once(block_size, drafted, width, adaptive):
    from dflash2_mlx.session import Session

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4) if drafted else None
    session = Session(spec=None, target=target, drafter=drafter, block_size=block_size)
    assert (session.width, session.adaptive) == (width, adaptive)
    assert session.prompt_cache().reserve >= width


@pytest.mark.parametrize("bad", ["wide", 1, "0"])
def test_a_session_refuses_a_bad_block_size_naming_it(bad):
    from dflash2_mlx.errors import ConfigError
    from dflash2_mlx.session import Session

    from tiny import tiny_target

    with pytest.raises(ConfigError, match=f"--block-size must be an integer >= 2 or 'auto', got '?{bad}'?"):
        Session(spec=None, target=tiny_target("llama"), drafter=None, block_size=bad)
