"""Diagnose: Recall@k, selector accuracy and the τ of each walk on a hand-made case; the
teacher-forced anchors of a tiny pair against the selector's own walk and the engine's cycles."""

import json

import mlx.core as mx
import pytest

from dflash2_mlx.core.generate import generate
from dflash2_mlx.diagnose import AnchorRecord, accept_length, collect_anchors, position_stats, run_diagnose
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.prompts import Prompt, SuitePrompts


def test_accept_length():
    assert accept_length([]) == 1
    assert accept_length([False, True, True]) == 1
    assert accept_length([True, True, False, True]) == 3
    assert accept_length([True] * 4) == 5


# Three anchors, block positions 1..3, k = 3 candidates (best first).
HAND = [
    # top-1 right at 1, wrong at 2 (truth is 2nd), right at 3; selector walks 1, 2 right, 3 wrong
    AnchorRecord(truth=[5, 6, 7], top=[[5, 1, 2], [9, 6, 3], [7, 8, 0]], walk=[5, 6, 8], pick=[5, 6, 7]),
    # truth never among the candidates at position 1
    AnchorRecord(truth=[4, 6, 7], top=[[5, 1, 2], [6, 9, 3], [7, 8, 0]], walk=[5, 6, 7], pick=[5, 6, 7]),
    # everything right for top-1; the selector switches away at position 2 (given the true predecessor)
    AnchorRecord(truth=[1, 2, 3], top=[[1, 9, 8], [2, 7, 6], [3, 5, 4]], walk=[1, 7, 6], pick=[1, 7, 3]),
]


def test_recall_selector_and_tau_by_hand():
    s = position_stats(HAND, top_k=3)
    assert s["n_anchors"] == 3 and s["block_positions"] == 3
    assert s["recall_at_1"] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert s["recall_at_k"] == pytest.approx([2 / 3, 1.0, 1.0])
    assert s["selector_pick"] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert s["selector_pick_when_recalled"] == pytest.approx([1.0, 2 / 3, 1.0])
    # accept lengths: top-1 (2, 1, 4); selector walk (3, 1, 2); oracle (4, 1, 4)
    assert s["tau"]["top1"] == pytest.approx(7 / 3)
    assert s["tau"]["selector"] == pytest.approx(2.0)
    assert s["tau"]["oracle"] == pytest.approx(3.0)
    assert s["conditional_acceptance"]["top1"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert s["conditional_acceptance"]["oracle"] == pytest.approx([2 / 3, 1.0, 1.0])


def test_recall_at_k_counts_only_the_first_k():
    s = position_stats(HAND, top_k=1)
    assert s["recall_at_k"] == s["recall_at_1"]
    assert s["tau"]["oracle"] == s["tau"]["top1"]


def test_v1_records_have_no_selector_columns():
    s = position_stats([AnchorRecord(truth=r.truth, top=r.top) for r in HAND], top_k=3)
    assert s["selector_pick"] is None and "selector" not in s["tau"]
    assert position_stats([]) == {"n_anchors": 0}


@pytest.fixture(scope="module")
def tiny_pair():
    from tiny import tiny_drafter, tiny_target

    target = tiny_target("qwen3")
    return target, tiny_drafter(target, "dflash2", block_size=5, top_k=8)


def _anchors_of(cycles, start):
    t, out = start, []
    for c in cycles:
        out.append((t, c))
        t += c.n_accepted + 1
    return out


def test_anchors_match_the_selector_walk_and_the_engine(tiny_pair):
    target, drafter = tiny_pair
    prompt = [1, 20, 21, 22, 23, 24]
    truth = generate(target, prompt, max_tokens=60).tokens
    ids = prompt + truth
    records = collect_anchors(target, drafter, ids, len(prompt), block_size=5)
    assert len(records) == len(truth) - 4
    for t, r in enumerate(records, start=len(prompt)):
        assert r.truth == ids[t + 1 : t + 5] and len(r.top) == 4 and all(len(c) == 8 for c in r.top)
        assert r.walk[0] in r.top[0] and r.pick[0] == r.walk[0]  # same predecessor (the anchor)
        for i in range(1, 4):  # while the walk is right, its predecessor is the true one
            if r.walk[:i] == r.truth[:i]:
                assert r.pick[i] == r.walk[i]
    recorder = RecordingDrafter(drafter)
    run = generate(target, prompt, drafter=recorder, max_tokens=60, block_size=5)
    assert run.tokens == truth
    by_anchor = dict(enumerate(records, start=len(prompt)))
    checked = 0
    for (t, c), proposed in zip(_anchors_of(run.cycles, len(prompt)), recorder.proposals):
        if t in by_anchor and c.width == 5:
            assert proposed == by_anchor[t].walk  # the engine drafted exactly what diagnose saw
            assert accept_length([w == x for w, x in zip(proposed, by_anchor[t].truth)]) == c.n_accepted + 1
            checked += 1
    assert checked >= 10


class RecordingDrafter:
    """The real drafter, recording each block it proposes."""

    def __init__(self, drafter):
        self.drafter, self.config, self.target, self.proposals = drafter, drafter.config, drafter.target, []

    def begin(self, reserve=0):
        return self.drafter.begin(reserve)

    def draft(self, *args, **kwargs):
        proposal = self.drafter.draft(*args, **kwargs)
        self.proposals.append(proposal.tokens[0].tolist())
        return proposal


def test_top1_is_the_argmax_of_the_draft_logits(tiny_pair):
    target, drafter = tiny_pair
    prompt = [1, 30, 31]
    ids = prompt + generate(target, prompt, max_tokens=12).tokens
    r = collect_anchors(target, drafter, ids, len(prompt), block_size=5)[0]
    block = mx.array([[ids[len(prompt)]] + [drafter.config.mask_token_id] * 4])
    from dflash2_mlx.diagnose import target_states

    hidden = target_states(target, ids[: len(prompt)], tuple(drafter.config.target_layer_ids))
    logits = drafter.logits(drafter.hidden_states(block, hidden, drafter.make_cache())[:, 1:])
    assert [row[0] for row in r.top] == mx.argmax(logits, axis=-1)[0].tolist()


def test_run_diagnose_report_has_every_field(tiny_pair):
    target, drafter = tiny_pair
    suites = [SuitePrompts("a", [Prompt("a", "0", "12 plus 3"), Prompt("a", "1", "why?")], "test", 2)]
    seen = []
    report = run_diagnose(target, drafter, suites, max_tokens=24, stride=2,
                          encode=lambda p: target.tokenizer.encode(p.text), on_prompt=seen.append)
    data = json.loads(json.dumps(report.to_json()))
    assert len(seen) == 2 and data["schema"] == "dflash2.diagnose/1"
    for scope in (data["overall"], data["by_suite"]["a"]):
        for key in ("recall_at_1", "recall_at_k", "selector_pick", "selector_pick_when_recalled"):
            assert len(scope[key]) == 4
        assert set(scope["tau"]) == {"actual", "top1", "selector", "oracle"}
        assert scope["tau"]["oracle"] >= max(scope["tau"]["top1"], scope["tau"]["selector"])
        assert all(k >= one for k, one in zip(scope["recall_at_k"], scope["recall_at_1"]))
        assert scope["actual_mismatches"] == 0 and scope["n_prompts"] == 2
    assert data["prompts"][0]["n_anchors"] == len(range(0, 24 - 4, 2))
    with pytest.raises(ConfigError, match="stride"):
        run_diagnose(target, drafter, suites, stride=0, encode=lambda p: [1, 2])
    with pytest.raises(ConfigError, match="drafter"):
        run_diagnose(target, None, suites)
