"""Drafter training: block mask, loss weights, selector targets, a step that learns, exact resume."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash2_mlx import load_drafter
from dflash2_mlx.train import onpolicy
from dflash2_mlx.train.corpus import iter_json_array
from dflash2_mlx.train.dataset import FeatureDataset
from dflash2_mlx.train.export import export_drafter
from dflash2_mlx.train.init import default_target_layer_ids, new_config, new_drafter, upgrade_to_v2
from dflash2_mlx.train.loop import TrainConfig, Trainer
from dflash2_mlx.train.loss import Batch, position_weights, selector_terms
from dflash2_mlx.train.model import FrozenParts, training_hidden, training_mask
from dflash2_mlx.train.shards import FeatureShard

from tiny import MASK_ID, tiny_drafter, tiny_target

PROMPTS = ["Hello there", "What is 2+2?", "Tell me a story.", "abc def ghi", "Why?", "Count: 1 2 3",
           "The quick brown fox", "Name three colors", "Say hi", "Explain rain"]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def features(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prompts = [{"i": i, "source": "test", "ids": target.tokenizer.encode(p)} for i, p in enumerate(PROMPTS)]
    onpolicy.start_run(root, {"taps": [0, 2, 3]}, prompts)
    onpolicy.generate_run(target, root, prompts, (0, 2, 3), segment_size=5, batch_size=4, max_new_tokens=25,
                          part_size=5, progress=False)
    return sorted((root / "feat").glob("*.safetensors"))


def test_generated_data_is_the_targets_own_greedy_continuation(target, features):
    from dflash2_mlx import generate

    root = features[0].parent.parent
    answers = list(onpolicy.iter_answers(root))
    assert len(answers) == len(PROMPTS)
    for prompt, row in answers[:2]:
        ours = generate(target, prompt["ids"], max_tokens=25).tokens
        assert row["response"] + [row["next"]] == ours
    shard = FeatureShard.load(features[0])
    assert shard.hidden.dtype == np.float16 and shard.hidden.shape[1] == 3 * 64
    first = shard.tokens[shard.offsets[0] : shard.offsets[1]]
    _, h = target.forward(mx.array([first.tolist()]), target.make_cache(), (0, 2, 3), logits="none")
    np.testing.assert_allclose(shard.hidden[: len(first)], np.array(h[0]).astype(np.float16), rtol=1e-2, atol=1e-2)


def test_truncated_json_array_yields_complete_elements(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[ {"a": 1}, {"b": [1, 2]}, {"c": "unfinish')
    assert list(iter_json_array(path, chunk_chars=7)) == [{"a": 1}, {"b": [1, 2]}]


def test_block_mask_sees_context_strictly_before_anchor_and_own_block_only():
    anchors = mx.array([[3, 6]])
    m = np.array(training_mask(anchors, n_ctx=8, valid_ctx=mx.array([8]), block_size=3, window=None,
                               causal=False))[0, 0]
    ctx, blk = m[:, :8], m[:, 8:]
    for q in range(6):
        a = q // 3
        assert ctx[q].tolist() == [p < [3, 6][a] for p in range(8)]
        assert blk[q].tolist() == [k // 3 == a for k in range(6)]
    causal = np.array(training_mask(anchors, 8, mx.array([8]), 3, None, True))[0, 0, :, 8:]
    assert causal[4].tolist() == [False, False, False, True, True, False]
    windowed = np.array(training_mask(anchors, 8, mx.array([8]), 3, 4, False))[0, 0, :, :8]
    assert windowed[5].tolist() == [p < 6 and 6 + 2 - p < 4 for p in range(8)]
    padded = np.array(training_mask(anchors, 8, mx.array([5]), 3, None, False))[0, 0, :, :8]
    assert not padded[:, 5:].any()


def test_training_forward_equals_inference_forward(target):
    for arch in ("dflash", "dflash2"):
        drafter = tiny_drafter(target, arch, block_size=5, sliding_window=8)
        ctx = mx.random.normal((1, 20, 3 * 64), key=mx.random.key(3))
        toks = mx.random.randint(3, 90, (1, 20), key=mx.random.key(4))
        anchors = mx.array([[4, 11, 17]])
        trained = training_hidden(drafter, ctx, mx.array([20]), mx.take_along_axis(toks, anchors, 1), anchors)
        for i, a in enumerate([4, 11, 17]):
            block = mx.array([[int(toks[0, a])] + [MASK_ID] * 4])
            ref = drafter.hidden_states(block, ctx[:, :a], drafter.make_cache())
            np.testing.assert_allclose(np.array(trained[0, i]), np.array(ref[0]), rtol=1e-5, atol=1e-5)


def test_position_weights():
    np.testing.assert_allclose(np.array(position_weights(16)), np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    np.testing.assert_allclose(np.array(position_weights(8)), np.exp(-np.arange(7) / 3.5), rtol=1e-6)
    assert float(position_weights(8, gamma=1.0)[2]) == pytest.approx(np.exp(-2.0))


def test_selector_targets_use_the_true_predecessor(target):
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=4)
    sel = drafter.candidate_selector
    logits = mx.full((1, 1, 2, 97), -10.0)
    logits = logits.at[0, 0, 0, mx.array([5, 6, 7, 8])].add(mx.array([14.0, 13.0, 12.0, 11.0]))
    logits = logits.at[0, 0, 1, mx.array([20, 21, 22, 23])].add(mx.array([14.0, 13.0, 12.0, 11.0]))
    batch = Batch(hidden=None, valid_ctx=None, anchors=None, anchor_tokens=mx.array([[9]]),
                  labels=mx.array([[[7, 40]]]), label_mask=mx.ones((1, 1, 2)))
    h = mx.random.normal((1, 1, 2, 64), key=mx.random.key(0))
    ce, _, in_set, _, _ = selector_terms(sel, h, logits, batch)
    assert np.array(in_set).tolist() == [[[True, False]]]  # 40 is not a candidate: excluded
    # Recompute position 0's CE by hand: predecessor = the anchor (9), target = index of 7.
    cands = np.array(mx.argpartition(logits, kth=-4, axis=-1)[..., -4:])[0, 0, 0]
    gate = np.array(sel.hidden_projection(h))[0, 0, 0]
    A, B = np.array(sel.predecessor_codebook.weight), np.array(sel.successor_codebook.weight)
    scores = np.array(logits)[0, 0, 0, cands] + (A[9] * gate * B[cands]).sum(-1)
    expected = -(scores[list(cands).index(7)] - np.log(np.exp(scores - scores.max()).sum()) - scores.max())
    assert float(ce[0, 0, 0]) == pytest.approx(expected, rel=1e-4)


def _trainer(target, features, out, arch="dflash2", steps=6, **kw):
    cfg = new_config(target, arch, n_layers=1, block_size=4, target_layer_ids=[0, 2, 3], mask_token_id=MASK_ID,
                     selector_rank=8, selector_top_k=8)
    train_cfg = TrainConfig(steps=steps, seqs_per_batch=3, anchors_per_seq=4, lr=3e-3, eval_every=3,
                            eval_blocks=(4,), save_every=3, seed=5, **kw)
    data = FeatureDataset(features)
    return Trainer(new_drafter(cfg, seed=1), FrozenParts.from_target(target), data, train_cfg, out, eval_data=data)


def test_one_step_reduces_loss(target, features, tmp_path):
    trainer = _trainer(target, features, tmp_path / "one")
    batch = trainer.make_batch(0)
    before, _ = trainer._loss(batch)
    trainer.step()
    after, _ = trainer._loss(batch)
    assert float(after) < float(before)


def test_kill_and_resume_equals_uninterrupted(target, features, tmp_path):
    full = _trainer(target, features, tmp_path / "full", steps=6)
    full.run(progress=False)
    part = _trainer(target, features, tmp_path / "part", steps=6)
    part.cfg.steps = 3
    part.run(progress=False)  # "killed" after the step-3 checkpoint
    resumed = _trainer(target, features, tmp_path / "part", steps=6)
    assert resumed.resume() and resumed.state.step == 3
    resumed.run(progress=False)
    a, b = dict(tree_flatten(full.drafter.parameters())), dict(tree_flatten(resumed.drafter.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


def test_trained_checkpoint_loads_in_the_published_layout(target, features, tmp_path):
    trainer = _trainer(target, features, tmp_path / "pub", steps=3)
    trainer.run(progress=False)
    names = set(mx.load(str(tmp_path / "pub" / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names
    assert not any(n.endswith("codebook.weight") for n in names)
    expected = {k.replace("_codebook.weight", "_codebook") for k, _ in tree_flatten(trainer.drafter.parameters())}
    assert names == expected
    drafter = load_drafter(tmp_path / "pub", target)
    assert drafter.config.is_v2 and drafter.config.block_size == 4


def test_export_casts_to_bf16_and_loads_back_with_the_same_names(target, features, tmp_path):
    trainer = _trainer(target, features, tmp_path / "run", steps=2)
    trainer.run(progress=False)
    out = export_drafter(tmp_path / "run" / "checkpoint", tmp_path / "bf16")
    fp32, bf16 = mx.load(str(tmp_path / "run" / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert fp32.keys() == bf16.keys() and all(v.dtype == mx.bfloat16 for v in bf16.values())
    for k in fp32:
        np.testing.assert_array_equal(np.array(fp32[k].astype(mx.bfloat16).astype(mx.float32)),
                                      np.array(bf16[k].astype(mx.float32)), err_msg=k)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_drafter(out, target).config.is_v2
    with pytest.raises(ValueError, match="int4"):
        export_drafter(out, tmp_path / "bad", "int4")


def test_upgrade_v1_to_v2_keeps_backbone_outputs(target):
    v1 = tiny_drafter(target, "dflash", sliding_window=16)
    v2 = upgrade_to_v2(v1, selector_rank=8, selector_top_k=8)
    v2.bind(target)
    ctx = mx.random.normal((1, 6, 3 * 64), key=mx.random.key(1))
    block = mx.array([[5] + [MASK_ID] * 7])
    np.testing.assert_allclose(np.array(v1.hidden_states(block, ctx, v1.make_cache())),
                               np.array(v2.hidden_states(block, ctx, v2.make_cache())), rtol=1e-5, atol=1e-5)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, 1) == [15]
