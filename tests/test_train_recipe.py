"""The training recipe's parts: the anchor sampler, the exact evaluation against the engine, the
soft-label KL and D-PACE weights against dense references, gold injection, the WSD schedule."""

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx import generate
from dflash2_mlx.train import onpolicy
from dflash2_mlx.train.dataset import AnchorSampler, FeatureDataset, eval_rows, tap_columns
from dflash2_mlx.train.evaluate import acceptance_lengths, anchor_lengths, simulate, walk
from dflash2_mlx.train.init import new_config, new_drafter
from dflash2_mlx.train.loop import TrainConfig, Trainer, lr_schedule
from dflash2_mlx.train.loss import Batch, dpace_weights, selector_terms, soft_label_kl
from dflash2_mlx.train.model import FrozenParts

from tiny import MASK_ID, tiny_drafter, tiny_target

TAPS = (0, 2, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("onp")
    rng = np.random.default_rng(0)
    prompts = [{"i": i, "source": "t", "ids": [1] + rng.integers(3, 90, size=rng.integers(2, 9)).tolist()}
               for i in range(24)]
    onpolicy.start_run(root, {"taps": list(TAPS)}, prompts)
    onpolicy.generate_run(target, root, prompts, TAPS, segment_size=12, batch_size=8, max_new_tokens=40,
                          top_k=8, part_size=6, progress=False)
    return root


def test_sampler_visits_every_anchor_once_per_epoch_and_sequences_by_their_tokens(target, data_dir):
    data = FeatureDataset(sorted((data_dir / "feat").glob("*.safetensors")))
    sampler = AnchorSampler(data, seqs_per_batch=3, anchors_per_seq=7, seed=4)
    steps = int(np.ceil(sampler.steps_per_epoch))
    seen = [(i, int(a)) for s in range(steps) for i, anchors in sampler.rows(s) for a in anchors]
    epoch = seen[: sum(int(n) for n in data.n_anchors)]
    assert len(set(epoch)) == len(epoch) == data.n_trainable  # every (sequence, anchor) once, no repeats
    per_seq = np.bincount([i for i, _ in epoch], minlength=len(data))
    np.testing.assert_array_equal(per_seq, data.n_anchors)  # drawn in proportion to trainable tokens
    assert all(len(a) <= 7 for s in range(steps) for _, a in sampler.rows(s))
    again = AnchorSampler(data, 3, 7, seed=4)
    for s in (0, steps - 1, steps + 2):  # a fresh sampler (a resumed run) gives the same rows
        assert [(i, a.tolist()) for i, a in again.rows(s)] == [(i, a.tolist()) for i, a in sampler.rows(s)]
    assert sampler.rows(steps + 2) != AnchorSampler(data, 3, 7, seed=5).rows(steps + 2)


def test_eval_rows_cover_every_anchor_in_order(target, data_dir):
    data = FeatureDataset(sorted((data_dir / "feat").glob("*.safetensors")))
    rows = eval_rows(data, 5)
    got = [(i, int(a)) for i, anchors in rows for a in anchors]
    want = [(i, int(a)) for i in range(len(data)) for a in data.anchor_positions(i)]
    assert got == want


def _trained_drafter(target, data_dir, steps=60):
    cfg = new_config(target, "dflash2", n_layers=1, block_size=4, target_layer_ids=list(TAPS), mask_token_id=MASK_ID,
                     selector_rank=8, selector_top_k=8)
    drafter = new_drafter(cfg, seed=3)
    data = FeatureDataset(sorted((data_dir / "feat").glob("*.safetensors")))
    tc = TrainConfig(steps=steps, seqs_per_batch=4, anchors_per_seq=16, lr=1e-2, eval_every=10_000, save_every=10_000)
    Trainer(drafter, FrozenParts.from_target(target), data, tc, data_dir / "run").run(progress=False)
    return drafter, data


def test_simulated_acceptance_equals_the_engines(target, data_dir):
    drafter, data = _trained_drafter(target, data_dir)
    lengths, _ = anchor_lengths(drafter, data, 4, anchors_per_seq=16)
    drafter.bind(target)
    answers = list(onpolicy.iter_answers(data_dir))
    compared = accepted = 0
    for i in range(len(data)):
        tokens = data._slice(i, "tokens").tolist()
        prompt = next(p["ids"] for p, _ in answers if tokens[: len(p["ids"])] == p["ids"])
        n_new = len(tokens) - len(prompt) + 1
        result = generate(target, prompt, max_tokens=n_new, drafter=drafter, block_size=4)
        engine = [c.n_accepted + 1 for c in result.speculative_cycles]
        simulated = walk(lengths[i])
        assert engine[:-1] == simulated[: len(engine) - 1], i  # the last cycle is cut by max_tokens
        compared += len(engine) - 1
        accepted += sum(engine[:-1]) - (len(engine) - 1)
    assert compared > 50 and accepted > 10  # the walk met real acceptances, not only rejections


def test_simulate_reports_walk_and_all_anchor_tau(target, data_dir):
    drafter, data = _trained_drafter(target, data_dir, steps=20)
    result = simulate(drafter, data, (4, 8), anchors_per_seq=16)
    for B in (4, 8):
        r = result[f"b{B}"]
        assert 1.0 <= r["tau"] <= B and 1.0 <= r["tau_all"] <= B and r["anchors"] == data.n_trainable
        assert len(r["accept_by_position"]) == B - 1
    assert acceptance_lengths(np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])).tolist() == [3, 1, 5]
    assert walk({5: 2, 6: 1, 7: 3, 8: 1, 9: 1, 10: 2}) == [2, 3, 2]


def test_soft_label_kl_equals_a_dense_reference():
    rng = np.random.default_rng(1)
    V, k = 11, 4
    logits = rng.normal(size=(2, 1, 3, V)).astype(np.float32)
    p_full = np.exp(rng.normal(size=(2, 1, 3, V)) * 2)
    p_full /= p_full.sum(-1, keepdims=True)
    ids = np.argsort(-p_full, axis=-1)[..., :k]
    lps = np.log(np.take_along_axis(p_full, ids, -1))
    lps[1, 0, 2] = -np.inf  # a position with no stored soft label
    got = np.array(soft_label_kl(mx.array(logits), mx.array(ids.astype(np.int32)), mx.array(lps.astype(np.float32))))
    q = np.exp(logits - logits.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    for idx in np.ndindex(2, 1, 3):
        if idx == (1, 0, 2):
            assert got[idx] == pytest.approx(0.0, abs=1e-6)
            continue
        top = ids[idx]
        p_top, q_top = p_full[idx][top], q[idx][top]
        p_rest, q_rest = 1 - p_top.sum(), 1 - q_top.sum()
        want = (p_top * np.log(p_top / q_top)).sum() + p_rest * np.log(p_rest / q_rest)
        assert got[idx] == pytest.approx(want, rel=1e-4, abs=1e-6)
    # Columns of a compact head: an id the head lacks moves its mass into the tail.
    column_index = np.full(V, -1, np.int32)
    kept = np.array([0, 2, 3, 5, 7, 8, 9, 10])
    column_index[kept] = np.arange(len(kept))
    sub = logits[..., kept]
    got = np.array(soft_label_kl(mx.array(sub), mx.array(ids.astype(np.int32)), mx.array(lps.astype(np.float32)),
                                 mx.array(column_index)))
    qs = np.exp(sub - sub.max(-1, keepdims=True))
    qs /= qs.sum(-1, keepdims=True)
    idx = (0, 0, 1)
    top = [t for t in ids[idx] if column_index[t] >= 0]
    p_top, q_top = p_full[idx][top], qs[idx][column_index[top]]
    want = (p_top * np.log(p_top / q_top)).sum() + (1 - p_top.sum()) * np.log((1 - p_top.sum()) / (1 - q_top.sum()))
    assert got[idx] == pytest.approx(want, rel=1e-4)


def test_dpace_weights_are_the_expected_reach():
    ce = np.array([[[0.5, 1.0, 2.0, 0.1]]], np.float32)
    mask = np.array([[[1, 1, 1, 0]]], np.float32)
    got = np.array(dpace_weights(mx.array(ce), mx.array(mask), alpha=0.5))
    q = 0.5 * np.exp(-ce[0, 0]) + 0.5
    q[3] = 0.0
    reach = np.cumprod(q)
    want = [reach[j:].sum() for j in range(4)]
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-5)


def test_gold_injection_puts_the_true_token_among_the_candidates(target):
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=4)
    logits = mx.full((1, 1, 2, 97), -10.0)
    logits = logits.at[0, 0, 0, mx.array([5, 6, 7, 8])].add(mx.array([14.0, 13.0, 12.0, 11.0]))
    logits = logits.at[0, 0, 1, mx.array([20, 21, 22, 23])].add(mx.array([14.0, 13.0, 12.0, 11.0]))
    batch = Batch(hidden=None, valid_ctx=None, anchors=None, anchor_tokens=mx.array([[9]]),
                  labels=mx.array([[[7, 40]]]), label_mask=mx.ones((1, 1, 2)))
    h = mx.random.normal((1, 1, 2, 64), key=mx.random.key(0))
    plain = selector_terms(drafter.candidate_selector, h, logits, batch)
    gold = selector_terms(drafter.candidate_selector, h, logits, batch, inject_gold=True)
    assert np.array(plain.trained)[0, 0].tolist() == [True, False]
    assert np.array(gold.trained)[0, 0].tolist() == [True, True]
    assert np.array(gold.in_set)[0, 0].tolist() == [True, False]  # Recall@k still counts the real top-k
    assert float(gold.ce[0, 0, 0]) == pytest.approx(float(plain.ce[0, 0, 0]), rel=1e-6)
    assert np.isfinite(float(gold.ce[0, 0, 1])) and float(gold.ce[0, 0, 1]) > 1.0  # 40 has a logit of -10


def test_wsd_schedule_is_stable_until_the_decay_and_extendable():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_frac=0.1, decay_frac=0.2, min_lr_frac=0.1)
    lr = lr_schedule(cfg)
    assert float(lr(0)) == pytest.approx(1e-5)
    assert float(lr(10)) == pytest.approx(1e-3) and float(lr(79)) == pytest.approx(1e-3)
    assert float(lr(90)) == pytest.approx(1e-3 - 0.5 * 0.9e-3, rel=1e-3) and float(lr(100)) == pytest.approx(1e-4)
    longer = lr_schedule(TrainConfig(steps=200, lr=1e-3, warmup_frac=0.05, decay_frac=0.1))
    assert all(float(longer(s)) == pytest.approx(float(lr(s))) for s in range(10, 80))


def test_loss_weights_ramp_from_start_to_end():
    cfg = TrainConfig(steps=100, ce_weight=1.0, ce_weight_end=0.1, selector_tv_weight=0.1, selector_tv_weight_end=0.9,
                      ramp_frac=0.5)
    assert cfg.loss_weights(0).ce == 1.0 and cfg.loss_weights(25).ce == pytest.approx(0.55)
    assert cfg.loss_weights(50).selector_tv == pytest.approx(0.9) and cfg.loss_weights(99).ce == pytest.approx(0.1)
    assert cfg.loss_weights(30).selector_ce == cfg.selector_weight


def test_tap_columns_pick_stored_taps():
    cols = tap_columns([1, 8, 14, 20, 27, 29], [1, 8, 14, 20, 27], 6 * 4)
    assert cols.tolist() == list(range(20))
    assert tap_columns([1, 8], [8], 8).tolist() == [4, 5, 6, 7]
    assert tap_columns([1, 8], None, 8) is None
    with pytest.raises(ValueError, match=r"\[3\]"):
        tap_columns([1, 8], [3], 8)


def test_tied_codebooks_train_resume_exactly_and_save_the_published_layout(target, data_dir, tmp_path):
    from dflash2_mlx import load_drafter
    from dflash2_mlx.train.tied import TiedCodebook

    def trainer(out, steps):
        cfg = new_config(target, "dflash2", n_layers=1, block_size=4, target_layer_ids=list(TAPS),
                         mask_token_id=MASK_ID, selector_rank=8, selector_top_k=8)
        data = FeatureDataset(sorted((data_dir / "feat").glob("*.safetensors")))
        tc = TrainConfig(steps=6, seqs_per_batch=3, anchors_per_seq=8, lr=3e-3, eval_every=100, save_every=3,
                         tie_codebooks=True, seed=2)
        t = Trainer(new_drafter(cfg, seed=3), FrozenParts.from_target(target), data, tc, out)
        t.cfg.steps = steps
        return t

    full = trainer(tmp_path / "full", 6)
    sel = full.drafter.candidate_selector
    assert isinstance(sel.predecessor_codebook, TiedCodebook)
    before = np.array(sel.successor_codebook.weight)
    full.run(progress=False)
    assert not np.allclose(before, np.array(sel.successor_codebook.weight))  # P and R trained
    part = trainer(tmp_path / "part", 3)
    part.run(progress=False)
    resumed = trainer(tmp_path / "part", 6)
    assert resumed.resume() and resumed.state.step == 3
    resumed.run(progress=False)
    for a, b in ((full, resumed),):
        for name in ("predecessor_codebook", "successor_codebook"):
            np.testing.assert_array_equal(np.array(getattr(a.drafter.candidate_selector, name).weight),
                                          np.array(getattr(b.drafter.candidate_selector, name).weight))
    loaded = load_drafter(tmp_path / "full", target)  # the final drafter: plain codebooks, published names
    np.testing.assert_allclose(np.array(loaded.candidate_selector.predecessor_codebook.weight),
                               np.array(sel.predecessor_codebook.weight), rtol=1e-6)
