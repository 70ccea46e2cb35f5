"""Bench: cycle-log arithmetic by hand, the loop detector on planted repetitions, pooled
summaries, and `run_bench` on a tiny pair producing every field."""

import json
import random

import pytest

from dflash2_mlx.bench import (
    BenchReport,
    Mode,
    RunRecord,
    loop_period,
    parse_modes,
    run_bench,
    summarize,
)
from dflash2_mlx.bench_plot import plot_acceptance
from dflash2_mlx.core.events import CycleStats
from dflash2_mlx.core.stats import acceptance_by_position, acceptance_counts, accepted_histogram, rates, tau
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.prompts import Prompt, SuitePrompts


def cycle(width, n_drafted, n_accepted):
    return CycleStats(width, n_drafted, n_accepted, n_accepted + 1, 0.0, 0.0)


HAND_LOG = [cycle(4, 3, 3), cycle(4, 3, 0), cycle(1, 0, 0), cycle(4, 3, 1), cycle(3, 2, 2)]


def test_tau_and_position_acceptance_by_hand():
    # τ over the four speculative cycles: (4 + 1 + 2 + 3) / 4; the plain step does not count.
    assert tau(HAND_LOG) == pytest.approx(2.5)
    # position 1: all 4 reached, 3 accepted; position 2: reached by the cycles with >= 2 drafts
    # and position 1 accepted (3/3/1 -> n_acc 3, 1, 2), accepted by n_acc >= 2 (2 of them);
    # position 3: needs 3 drafts and n_acc >= 2 -> only the first cycle, accepted.
    assert acceptance_counts(HAND_LOG) == [(3, 4), (2, 3), (1, 1)]
    assert rates(acceptance_counts(HAND_LOG)) == pytest.approx([0.75, 2 / 3, 1.0])
    assert acceptance_by_position(HAND_LOG) == pytest.approx([0.75, 2 / 3, 1.0])
    assert accepted_histogram(HAND_LOG) == [1, 1, 1, 1]
    assert tau([cycle(1, 0, 0)], empty=None) is None and tau([]) == 1.0 and acceptance_counts([]) == []
    assert rates([(0, 0), (1, 2)]) == [None, 0.5]


def test_the_servers_running_counts_give_the_same_tau():
    from types import SimpleNamespace

    from dflash2_mlx.server.metrics import Metrics
    from dflash2_mlx.server.worker import JobStats

    rng = random.Random(0)
    log = []
    for _ in range(300):
        width = rng.choice([1, 2, 4, 8])
        log.append(cycle(width, width - 1, rng.randint(0, width - 1)) if width > 1 else cycle(1, 0, 0))
    job = JobStats()
    for c in log:
        job.observe(SimpleNamespace(prompt_tokens=3, generation_tokens=1, finish_reason=None, stop_sequence=None,
                                    cycle=c, cached_tokens=0))
    metrics = Metrics()
    metrics.job_ended(SimpleNamespace(id="x", stats=job))
    assert job.tokens_per_cycle == pytest.approx(tau(log)) == pytest.approx(metrics.tokens_per_cycle())


@pytest.mark.parametrize("period", [1, 2, 7, 32])
def test_loop_detector_finds_planted_loops(period):
    rng = random.Random(period)
    unit = [rng.randrange(100) for _ in range(period)]
    while len(set(unit)) < min(period, 2):  # a unit of one repeated token would have period 1
        unit = [rng.randrange(100) for _ in range(period)]
    head = [rng.randrange(100, 200) for _ in range(50)]
    tokens = head + unit * (64 // period + 2)
    assert loop_period(tokens) == period


def test_loop_detector_ignores_non_loops():
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(200)]
    assert loop_period(text) is None
    assert loop_period([5] * 63) is None  # shorter than the window
    unit = list(range(40))
    assert loop_period([900] * 10 + unit * 3) is None  # period 40 > 32: not "short"
    late = text[:150] + [7, 8, 9] * 17  # loop covers only 51 of the last 64 tokens
    assert loop_period(late) is None
    assert loop_period(text[:100] + [7, 8] * 40) == 2  # shortest period, not 4 or 6


def test_parse_modes():
    assert parse_modes("ar, dflash,dflash2@4,dflash2@auto") == [
        ("ar", None), ("dflash", None), ("dflash2", 4), ("dflash2", "auto")]
    for bad in ("eagle", "ar@4", "dflash2@1", "dflash2@x", ","):
        with pytest.raises(ConfigError):
            parse_modes(bad)


def record(mode, prompt_id, n_tokens, decode_s, loop=None, cycles=(), suite="s"):
    return RunRecord(suite=suite, prompt_id=prompt_id, mode=mode, n_prompt_tokens=10, n_tokens=n_tokens,
                     finish_reason="length", prompt_tps=100.0, ttft_s=0.1, decode_s=decode_s,
                     total_s=decode_s + 0.1, peak_memory_gb=1.0,
                     cycles=[[c.width, c.n_drafted, c.n_accepted, c.n_emitted, 0.0, 0.0] for c in cycles],
                     loop_period=loop)


def test_summary_pools_rates_and_drops_looping_prompts_from_every_mode():
    recs = [record("ar", "a", 11, 1.0), record("ar", "b", 21, 4.0),
            record("spec", "a", 11, 0.5, cycles=HAND_LOG[:2]), record("spec", "b", 21, 1.0, loop=3)]
    s = summarize(recs, ["ar", "spec"])
    assert s["ar"]["decode_tps"] == pytest.approx(30 / 5.0)  # pooled, not the mean of 10 and 5
    assert s["spec"]["decode_tps"] == pytest.approx(30 / 1.5)
    assert s["spec"]["speedup"] == pytest.approx(20 / 6)
    assert s["spec"]["tau"] == pytest.approx(2.5) and s["spec"]["n_loops"] == 1
    assert s["ar"]["prompt_tps"] == pytest.approx(100.0)
    report = BenchReport(settings={}, suites=[{"name": "s"}], modes=[{"name": "ar"}, {"name": "spec"}],
                         records=recs)
    clean = report.summary(exclude_loops=True)
    assert clean["excluded_prompts"] == ["s/b"]
    assert clean["overall"]["ar"]["n_runs"] == 1 and clean["overall"]["spec"]["n_runs"] == 1
    assert clean["overall"]["spec"]["speedup"] == pytest.approx((10 / 0.5) / (10 / 1.0))


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    v1 = tiny_drafter(target, "dflash", block_size=5)
    v2 = tiny_drafter(target, "dflash2", block_size=5)
    modes = [Mode("ar", "ar"), Mode("dflash", "dflash", v1, drafter_path="v1"),
             Mode("dflash2", "dflash2", v2, drafter_path="v2"),
             Mode("dflash2@auto", "dflash2", v2, "auto", drafter_path="v2")]
    suites = [SuitePrompts("math", [Prompt("math", str(i), f"{i} plus {i} is") for i in range(2)], "test", 2),
              SuitePrompts("code", [Prompt("code", "x", "def f(x):")], "test", 1)]
    encode = lambda p: target.tokenizer.encode(p.text)  # noqa: E731
    seen = []
    report = run_bench(target, modes, suites, max_tokens=24, encode=encode, on_run=seen.append,
                       cache_dir=tmp_path_factory.mktemp("cal"))
    return report, seen


def test_run_bench_interleaves_modes_and_rotates_their_order(tiny_report):
    report, seen = tiny_report
    assert [r.mode for r in seen] == [
        "ar", "dflash", "dflash2", "dflash2@auto",
        "dflash", "dflash2", "dflash2@auto", "ar",
        "dflash2", "dflash2@auto", "ar", "dflash"]
    assert [(r.suite, r.prompt_id) for r in seen[::4]] == [("math", "0"), ("math", "1"), ("code", "x")]


def test_run_bench_outputs_are_lossless_and_every_field_is_there(tiny_report):
    report, _ = tiny_report
    data = json.loads(json.dumps(report.to_json()))
    assert data["schema"] == "dflash2.bench/1"
    assert {"machine", "settings", "suites", "modes", "summary", "summary_without_loops", "loops", "runs"} <= set(data)
    assert len(data["runs"]) == 12
    run_fields = {"suite", "prompt_id", "mode", "n_prompt_tokens", "n_tokens", "finish_reason", "prompt_tps",
                  "ttft_s", "decode_s", "decode_tps", "total_s", "peak_memory_gb", "cycles", "tokens", "text",
                  "tau", "loop_period", "matches_ar"}
    for run in data["runs"]:
        assert run_fields <= set(run)
        assert run["n_tokens"] == 24 and run["ttft_s"] > 0 and run["decode_s"] > 0
        assert run["matches_ar"] is (None if run["mode"] == "ar" else True)
    for scope in [data["summary"]["overall"], *data["summary"]["by_suite"].values()]:
        assert set(scope) == {"ar", "dflash", "dflash2", "dflash2@auto"}
        for mode, figures in scope.items():
            for key in ("prompt_tps", "ttft_s", "decode_tps", "e2e_tps", "speedup", "e2e_speedup",
                        "acceptance_by_position", "peak_memory_gb", "n_loops", "n_mismatch_vs_ar"):
                assert key in figures
            assert figures["peak_memory_gb"] > 0 and figures["decode_tps"] > 0
        assert scope["ar"]["speedup"] == 1.0 and scope["ar"]["tau"] is None
        assert len(scope["dflash2"]["acceptance_by_position"]) == 4
        assert 1.0 <= scope["dflash2"]["tau"] <= 5.0
    auto = next(m for m in data["modes"] if m["name"] == "dflash2@auto")
    assert auto["max_width"] == 5 and len(auto["policy"]["calibrated_target_s"]) == 5


def test_plot_writes_a_png(tiny_report, tmp_path):
    pytest.importorskip("matplotlib")
    report, _ = tiny_report
    plot_acceptance(report, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_bench_rejects_bad_settings():
    from tiny import tiny_target

    target = tiny_target("llama")
    suites = [SuitePrompts("s", [Prompt("s", "0", "hi")], "test", 1)]
    with pytest.raises(ConfigError, match="distinct"):
        run_bench(target, [Mode("ar", "ar"), Mode("ar", "ar")], suites, encode=lambda p: [1, 2])
    with pytest.raises(ConfigError, match="max_tokens"):
        run_bench(target, [Mode("ar", "ar")], suites, max_tokens=0, encode=lambda p: [1, 2])


def test_sampled_runs_share_a_seed_per_prompt_across_modes():
    from dflash2_mlx.core.sampling import SamplingParams

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    modes = [Mode("ar", "ar"), Mode("dflash2", "dflash2", tiny_drafter(target, "dflash2", block_size=4))]
    suites = [SuitePrompts("s", [Prompt("s", str(i), f"x{i}") for i in range(3)], "test", 3)]
    report = run_bench(target, modes, suites, max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=5),
                       encode=lambda p: target.tokenizer.encode(p.text), warmup=False)
    seeds = {(r.prompt_id, r.mode): r.seed for r in report.records}
    assert [seeds[(p, "ar")] for p in "012"] == [5, 6, 7]
    assert all(seeds[(p, "ar")] == seeds[(p, "dflash2")] for p in "012")
    assert all(r.matches_ar is None for r in report.records)  # outputs may differ at T > 0


def test_mlx_lm_reference_mode_and_isolated_costs(tmp_path):
    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    v2 = tiny_drafter(target, "dflash2", block_size=5)
    modes = [Mode("mlx_lm", "mlx_lm"), Mode("ar", "ar"), Mode("dflash2@4", "dflash2", v2, 4, drafter_path="v2")]
    suites = [SuitePrompts("math", [Prompt("math", str(i), f"{i} plus {i} is") for i in range(2)], "test", 2)]
    report = run_bench(target, modes, suites, max_tokens=20, encode=lambda p: target.tokenizer.encode(p.text),
                       cache_dir=tmp_path)
    runs = {(r.mode, r.prompt_id): r for r in report.records}
    for pid in ("0", "1"):  # mlx-lm's own loop emits exactly our plain tokens
        assert runs[("mlx_lm", pid)].tokens == runs[("ar", pid)].tokens and runs[("mlx_lm", pid)].matches_ar
        assert runs[("mlx_lm", pid)].cycles == [] and runs[("mlx_lm", pid)].n_tokens == 20
    overall = report.summary()["overall"]
    assert overall["mlx_lm"]["speedup_vs_mlx_lm"] == 1.0
    assert overall["ar"]["speedup_vs_mlx_lm"] == pytest.approx(overall["ar"]["decode_tps"]
                                                               / overall["mlx_lm"]["decode_tps"])
    iso = {m["name"]: m.get("isolated") for m in report.modes}
    assert iso["mlx_lm"] is None and iso["ar"] is None
    assert iso["dflash2@4"]["width"] == 4 and iso["dflash2@4"]["draft_ms"] > 0 and iso["dflash2@4"]["verify_ms"] > 0
    spec = overall["dflash2@4"]
    alone = iso["dflash2@4"]["draft_ms"] + iso["dflash2@4"]["verify_ms"]
    assert spec["cycle_over_isolated"] == pytest.approx(spec["cycle_ms"] / alone)
    assert spec["cycle_ms"] == pytest.approx(spec["draft_ms"] + spec["verify_ms"])
    with pytest.raises(ConfigError, match="no block size"):
        parse_modes("mlx_lm@4")


def test_repeats_prefill_once_per_mode_and_decode_again_from_each_mode_cache(tmp_path):
    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    v2 = tiny_drafter(target, "dflash2", block_size=5, sliding_window=8)  # the drafter's window trims back
    modes = [Mode("mlx_lm", "mlx_lm"), Mode("ar", "ar"), Mode("dflash2@4", "dflash2", v2, 4, drafter_path="v2"),
             Mode("dflash2@auto", "dflash2", v2, "auto", drafter_path="v2")]
    prompt = Prompt("long", "0", " ".join(f"w{i}" for i in range(40)))
    ids = target.tokenizer.encode(prompt.text)
    seen = []
    report = run_bench(target, modes, [SuitePrompts("long", [prompt], "test", 1)], max_tokens=20,
                       encode=lambda p: target.tokenizer.encode(p.text), on_run=seen.append, cache_dir=tmp_path,
                       repeats=3, isolated=False)
    names = [m.name for m in modes]
    assert [r.mode for r in seen] == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert [r.repeat for r in seen] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r.n_cached == (0 if r.repeat == 0 else len(ids) - 1) for r in seen)
    first_ar = next(r for r in seen if r.mode == "ar")
    assert all(r.tokens == first_ar.tokens and r.matches_ar for r in seen if r is not first_ar)
    assert all(r.other_caches_gb > 0 for r in seen[4:])  # every mode's cache holds its prompt by then
    overall = report.summary()["overall"]
    for name in names:
        assert overall[name]["n_runs"] == 3 and overall[name]["n_tokens"] == 60
        assert overall[name]["n_prefills"] == 1 and overall[name]["n_prompt_tokens"] == len(ids)  # the one prefill
        assert overall[name]["ttft_s"] == next(r.ttft_s for r in seen if r.mode == name)
        peaks = [r.peak_memory_gb - r.other_caches_gb for r in seen if r.mode == name]
        assert overall[name]["peak_memory_gb"] == max(peaks)
    assert report.settings["repeats"] == 3
    with pytest.raises(ConfigError, match="repeats must be >= 1, got 0"):
        run_bench(target, modes[:2], [SuitePrompts("long", [prompt], "test", 1)], repeats=0, encode=lambda p: [1, 2])


def test_repeats_with_the_mlx_lm_mode_are_refused_naming_an_untrimmable_cache():
    from tiny import tiny_target

    target = tiny_target("qwen3_5")
    suites = [SuitePrompts("s", [Prompt("s", "0", "hi")], "test", 1)]
    with pytest.raises(ConfigError, match="needs trimmable caches; this target has \\['ArraysCache'\\]"):
        run_bench(target, [Mode("mlx_lm", "mlx_lm"), Mode("ar", "ar")], suites, repeats=2, encode=lambda p: [1, 2])


def test_turn_tokens_start_every_run_from_one_prefilled_prefix_and_prefill_only_the_turn(tmp_path):
    from dflash2_mlx.core.generate import generate

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("llama")
    v2 = tiny_drafter(target, "dflash2", block_size=5, sliding_window=8)  # the prefix runs past its window
    modes = [Mode("mlx_lm", "mlx_lm"), Mode("ar", "ar"), Mode("dflash2@4", "dflash2", v2, 4, drafter_path="v2"),
             Mode("dflash2@auto", "dflash2", v2, "auto", drafter_path="v2")]
    prompt = Prompt("long", "0", " ".join(f"w{i}" for i in range(40)))
    ids = target.tokenizer.encode(prompt.text)
    seen = []
    report = run_bench(target, modes, [SuitePrompts("long", [prompt], "test", 1)], max_tokens=20,
                       encode=lambda p: target.tokenizer.encode(p.text), on_run=seen.append, cache_dir=tmp_path,
                       repeats=2, isolated=False, turn_tokens=7)
    assert len(seen) == 8 and all(r.n_cached == len(ids) - 7 and r.n_prefilled == 7 for r in seen)
    # the prefix state is the prompt's: every run equals plain decoding of the whole prompt from scratch
    plain = generate(target, ids, max_tokens=20).tokens
    assert all(r.tokens == plain for r in seen), [r.mode for r in seen if r.tokens != plain]
    assert all(r.matches_ar for r in seen if r.mode != "ar" or r.repeat)
    assert all(r.other_caches_gb > 0 for r in seen)  # the kept prefix is not the run's own memory
    overall = report.summary()["overall"]
    for m in modes:
        f = overall[m.name]
        assert f["n_prefills"] == 2 and f["n_prefilled_tokens"] == 14 and f["n_prompt_tokens"] == 2 * len(ids)
        turn_s = sum(7 / r.prompt_tps for r in seen if r.mode == m.name)
        assert f["prompt_tps"] == pytest.approx(14 / turn_s)
    assert report.settings["turn_tokens"] == 7 and report.to_json()["runs"][0]["n_prefilled"] == 7


def test_turn_tokens_refuse_a_turn_without_a_prefix_and_a_reference_on_recurrent_caches():
    from tiny import tiny_target

    suites = [SuitePrompts("s", [Prompt("s", "0", "hi")], "test", 1)]
    target = tiny_target("llama")
    with pytest.raises(ConfigError, match="--turn-tokens 3 leaves no cached prefix in a 3-token prompt; use at most 2"):
        run_bench(target, [Mode("ar", "ar")], suites, turn_tokens=3, encode=lambda p: [1, 2, 3])
    with pytest.raises(ConfigError, match="--turn-tokens must be >= 1, got 0"):
        run_bench(target, [Mode("ar", "ar")], suites, turn_tokens=0, encode=lambda p: [1, 2, 3])
    target = tiny_target("qwen3_5")
    with pytest.raises(ConfigError, match="needs K/V caches in every layer; this target has \\['RecurrentCache'\\]"):
        run_bench(target, [Mode("mlx_lm", "mlx_lm"), Mode("ar", "ar")], suites, turn_tokens=1,
                  encode=lambda p: [1, 2, 3])


def test_turn_tokens_on_a_recurrent_target_start_from_the_exact_prefix_state():
    from dflash2_mlx.core.generate import generate

    from tiny import tiny_drafter, tiny_target

    target = tiny_target("qwen3_5")
    v2 = tiny_drafter(target, "dflash2", block_size=4)
    prompt = Prompt("s", "0", " ".join(f"w{i}" for i in range(30)))
    ids = target.tokenizer.encode(prompt.text)
    report = run_bench(target, [Mode("ar", "ar"), Mode("dflash2@4", "dflash2", v2, 4)],
                       [SuitePrompts("s", [prompt], "test", 1)], max_tokens=12, turn_tokens=4, isolated=False,
                       encode=lambda p: target.tokenizer.encode(p.text))
    plain = generate(target, ids, max_tokens=12).tokens
    assert [(r.n_prefilled, r.tokens) for r in report.records] == [(4, plain), (4, plain)]
