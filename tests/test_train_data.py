"""Teacher-forced training data: labels are the target's argmax, eval suites never enter it,
the subset-vocabulary loss equals the full loss when the subset is everything."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from dflash2_mlx import prompts as suites
from dflash2_mlx.cli import app
from dflash2_mlx.train.corpus import (
    EvalFilter,
    conversation_ids,
    filter_documents,
    heldout_prompts,
    python_sources,
    training_prompts,
)
from dflash2_mlx.train.data import teacher_forced_features
from dflash2_mlx.train.dataset import AnchorSampler, FeatureDataset
from dflash2_mlx.train.loss import Batch, LossWeights, TrainVocab, drafter_loss, position_weights, selector_terms
from dflash2_mlx.train.model import FrozenParts, training_hidden
from dflash2_mlx.train.shards import FeatureShard

from tiny import MASK_ID, save_tiny_pair, tiny_drafter, tiny_target

TEMPLATE = ("{% for m in messages %}{{ 'U: ' if m.role == 'user' else 'A: ' }}{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}A: {% endif %}")
DOCS = [
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, friend!"}],
    [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 5"},
     {"role": "user", "content": "More?"}, {"role": "assistant", "content": "6 7 8."}],
    [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "Rayleigh scattering."}],
]


@pytest.fixture(scope="module")
def target():
    t = tiny_target("qwen3")
    t.tokenizer._tokenizer.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def shards(target, tmp_path_factory):
    return teacher_forced_features(target, DOCS, (0, 2, 3), tmp_path_factory.mktemp("tf"), max_len=40, shard_size=2)


def test_conversation_ids_mark_assistant_turns_only(target):
    ids, trainable = conversation_ids(target.tokenizer, DOCS[1], max_len=200)
    text = target.tokenizer.decode(ids)
    assert text == "U: Count.\nA: 1 2 3 4 5\nU: More?\nA: 6 7 8.\n"
    marked = "".join(target.tokenizer.decode([t]) for t, ok in zip(ids, trainable) if ok)
    assert marked == "1 2 3 4 5\n6 7 8.\n"
    cut, cut_ok = conversation_ids(target.tokenizer, DOCS[1], max_len=10)
    assert cut == ids[:10] and cut_ok == trainable[:10]


def test_teacher_forced_labels_are_the_targets_argmax(target, shards):
    assert [p.name for p in shards] == ["tf-00000.safetensors", "tf-00001.safetensors"]
    n_seen = 0
    for path in shards:
        shard = FeatureShard.load(path)
        for i in range(len(shard)):
            a, b = shard.offsets[i], shard.offsets[i + 1]
            seq = shard.tokens[a:b].tolist()
            logits, h = target.forward(mx.array([seq]), target.make_cache(), (0, 2, 3), logits="all")
            assert shard.labels[a:b].tolist() == np.array(mx.argmax(logits[0], axis=-1)).tolist()
            np.testing.assert_allclose(shard.hidden[a:b], np.array(h[0]).astype(np.float16), rtol=1e-2, atol=1e-2)
            expected_ok = conversation_ids(target.tokenizer, DOCS[n_seen], 40)[1]
            assert shard.anchor_ok[a:b].tolist() == expected_ok
            n_seen += 1
    assert n_seen == len(DOCS)


def test_teacher_forced_shards_resume_by_skipping_done_ones(target, shards):
    before = [p.stat().st_mtime_ns for p in shards]
    again = teacher_forced_features(target, DOCS, (0, 2, 3), shards[0].parent, max_len=40, shard_size=2)
    assert again == shards and [p.stat().st_mtime_ns for p in again] == before


def test_blocks_take_argmax_labels_inside_assistant_turns(target, shards):
    data = FeatureDataset(shards, chain_labels=False)  # chained labels: the next test
    rows = AnchorSampler(data, 6, 5, seed=0).rows(0)
    batch = data.batch(rows, block_size=4, n_anchors=5)
    anchors, labels, mask = np.array(batch.anchors), np.array(batch.labels), np.array(batch.label_mask)
    assert mask.sum() > 0
    checked = 0
    for i, (seq, picked) in enumerate(rows):
        n = int(batch.valid_ctx[i])
        ok_all, seq_labels = data._slice(seq, "anchor_ok"), data._slice(seq, "labels")
        assert n == data.ends[seq] - data.starts[seq]
        assert anchors[i, : len(picked)].tolist() == picked.tolist()
        for a, t in enumerate(picked):
            assert ok_all[t]
            for k in range(3):
                pos = t + k
                ok = pos < n and ok_all[pos]
                assert bool(mask[i, a, k]) == ok
                if ok:
                    assert labels[i, a, k] == seq_labels[pos]
                    checked += 1
        assert not mask[i, len(picked) :].any()  # unused anchor slots count nothing
    assert checked > 10


def test_old_shards_without_labels_derive_them(tmp_path):
    tokens = np.arange(10, dtype=np.int32)
    shard = FeatureShard(tokens, np.array([0, 4, 10]), np.array([2, 1], dtype=np.int32),
                         np.zeros((10, 3), np.float16))
    assert shard.labels[:-1].tolist() == list(range(1, 10))
    assert shard.anchor_ok.tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 1, 1]


def test_a_planted_benchmark_question_is_filtered_out():
    flt = EvalFilter.from_suites()
    assert flt.items > 100
    for name in suites.DEFAULT_SUITES:
        item = suites.load_suite(name, 3).prompts[1].text
        words = item.split()
        planted = "Here is something I found:  " + " ".join(words[: min(len(words), 40)]).upper() + " thanks"
        doc = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": planted}]
        assert not flt.keep(doc), name
    clean = [{"role": "user", "content": "Tell me about the history of tea in China."},
             {"role": "assistant", "content": "Tea has been drunk in China for thousands of years."}]
    planted = [{"role": "user", "content": suites.load_suite("gsm8k", 1).prompts[0].text}]
    kept, dropped = filter_documents([clean, planted, clean], 5, flt)
    assert kept == [clean, clean] and dropped == 1


def test_training_prompts_drop_eval_questions_and_never_meet_the_heldout_ones():
    flt = EvalFilter.from_suites()
    question = suites.load_suite("gsm8k", 1).prompts[0].text
    convs = [[{"role": "user", "content": f"Tell me fact {i} about tea, please."}] for i in range(20)]
    convs[2] = [{"role": "user", "content": "Solve this: " + question}]
    convs[-2] = [{"role": "user", "content": question}]
    convs[-4] = convs[1]  # the same prompt near both ends: never held out
    train = training_prompts(7, eval_filter=flt, convs=convs)
    held = heldout_prompts(7, eval_filter=flt, convs=convs)
    assert len(train) == len(held) == 7
    assert not any(question in p for p in train + held)
    assert not set(train) & set(held)
    assert train[:2] == [convs[0][0]["content"], convs[1][0]["content"]] and held[:2] == [convs[-1][0]["content"],
                                                                                           convs[-3][0]["content"]]


def test_an_eval_set_sharing_a_prompt_with_the_training_data_is_caught(shards, target, tmp_path):
    train = FeatureDataset(shards)
    other = teacher_forced_features(target, [DOCS[1], [{"role": "user", "content": "New question?"},
                                                       {"role": "assistant", "content": "New answer."}]],
                                    (0, 2, 3), tmp_path, max_len=40, shard_size=2)
    assert len(train.prompt_keys()) == len(DOCS)
    assert len(train.prompt_keys() & FeatureDataset(other).prompt_keys()) == 1  # DOCS[1] is in both


@pytest.mark.usefixtures("isolated")
def test_fit_refuses_an_eval_set_that_is_not_held_out(target, tmp_path):
    teacher_forced_features(target, DOCS, (0, 2, 3), tmp_path / "data" / "feat", max_len=40, shard_size=2)
    target_dir, _ = save_tiny_pair(tmp_path, "qwen3")
    args = ("train", "fit", target_dir, "--data", tmp_path / "data", "--eval-data", tmp_path / "data",
            "--steps", 1, "--mask-token-id", MASK_ID, "--out", tmp_path / "run")
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "3 of the 3 evaluation sequences have a prompt that is also in the training data" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("isolated")
def test_fit_warm_starts_a_block_8_drafter_at_block_4(target, tmp_path):
    import json

    from dflash2_mlx.drafter.load import load_drafter

    teacher_forced_features(target, DOCS, (0, 2, 3), tmp_path / "data" / "feat", max_len=40, shard_size=2)
    target_dir, drafter_dir = save_tiny_pair(tmp_path, "qwen3")
    args = ("train", "fit", target_dir, "--data", tmp_path / "data", "--warm-start", drafter_dir, "--block-size", 4,
            "--steps", 1, "--seqs", 1, "--anchors", 2, "--lr", 0, "--out", tmp_path / "run")
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dflash_config"]["block_size"] == 4
    before = dict(tree_flatten(load_drafter(drafter_dir, dtype="float32").parameters()))
    after = dict(tree_flatten(load_drafter(tmp_path / "run", dtype="float32").parameters()))
    assert before.keys() == after.keys()
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)  # lr 0: the warm start's weights


def test_short_eval_items_match_whole_and_long_ones_by_ngrams():
    flt = EvalFilter(["Write a function to add two numbers", "one two three four five six seven eight nine ten "
                      "eleven twelve"], n=10)
    assert flt.contaminated("please: write a FUNCTION to add two numbers, now")
    assert not flt.contaminated("write a function to add numbers")
    assert flt.contaminated("x three four five six seven eight nine ten eleven twelve y")
    assert not flt.contaminated("one two three four five six seven eight nine")


def test_python_sources_are_assistant_code_replies(tmp_path):
    (tmp_path / "mod.py").write_text("import os\n\n" + "".join(f"def f{i}():\n    return {i}\n\n" for i in range(80)))
    docs = python_sources(tmp_path, chunk_chars=400)
    assert len(docs) > 3
    for doc in docs:
        assert doc[0]["role"] == "user" and "`mod`" in doc[0]["content"]
        assert doc[1]["content"].startswith("```python\n") and doc[1]["content"].endswith("\n```")
    joined = "\n".join(d[1]["content"][10:-4] for d in sorted(docs, key=lambda d: int(d[0]["content"].split()[3])))
    assert "def f0():" in joined and "def f79():" in joined


def _batch(target, vocab_size=97, S=2, T=12, A=3, B=4, seed=0):
    rng = np.random.default_rng(seed)
    return Batch(mx.array(rng.standard_normal((S, T, 3 * 64)).astype(np.float32)), mx.array([T, T - 2]),
                 mx.array(rng.integers(0, T - 4, (S, A)).astype(np.int32)),
                 mx.array(rng.integers(3, vocab_size, (S, A)).astype(np.int32)),
                 mx.array(rng.integers(3, vocab_size, (S, A, B - 1)).astype(np.int32)), mx.ones((S, A, B - 1)))


def test_train_vocab_over_every_id_equals_the_full_loss(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4, top_k=8)
    drafter.target = FrozenParts.from_target(target)
    V = drafter.config.vocab_size
    batch, w = _batch(target, V), position_weights(4)
    lw = LossWeights(0.1, 0.1, 0.9)
    full_loss, full_m = drafter_loss(drafter, batch, w, lw)
    vocab = TrainVocab(np.arange(V), V)
    sub_loss, sub_m = drafter_loss(drafter, batch, w, lw, vocab, vocab.head(drafter.target))
    assert float(sub_loss) == pytest.approx(float(full_loss), rel=1e-5)
    for k in full_m:
        np.testing.assert_allclose(np.array(sub_m[k]), np.array(full_m[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_train_vocab_counts_labels_outside_it_as_misses(target):
    drafter = tiny_drafter(target, "dflash2", block_size=4, top_k=8)
    drafter.target = FrozenParts.from_target(target)
    V = drafter.config.vocab_size
    batch = _batch(target, V)
    keep = np.unique(np.array(batch.labels)[0, 0])  # only a few labels are in the vocab
    vocab = TrainVocab(np.union1d(keep, np.arange(3, 20)), V)
    _, m = drafter_loss(drafter, batch, position_weights(4), LossWeights(), vocab, vocab.head(drafter.target))
    labels = np.array(batch.labels)
    in_vocab = np.isin(labels, np.array(vocab.ids)).mean(axis=(0, 1))
    assert (np.array(m["recall"]) <= in_vocab + 1e-6).all() and (np.array(m["top1"]) <= in_vocab + 1e-6).all()
    with pytest.raises(ValueError, match="sorted"):
        TrainVocab([5, 3], V)


def test_selector_tv_is_one_minus_the_true_candidates_probability(target):
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=4)
    logits = mx.random.normal((1, 1, 2, 97), key=mx.random.key(2)) * 3
    cands = np.array(mx.argpartition(logits, kth=-4, axis=-1)[..., -4:])[0, 0]
    labels = mx.array([[[int(cands[0, 2]), int(cands[1, 0])]]])
    batch = Batch(None, None, None, mx.array([[9]]), labels, mx.ones((1, 1, 2)))
    h = mx.random.normal((1, 1, 2, 64), key=mx.random.key(0))
    ce, tv, in_set, _, _ = selector_terms(drafter.candidate_selector, h, logits, batch)
    assert np.array(in_set).all()
    np.testing.assert_allclose(np.array(tv), 1 - np.exp(-np.array(ce)), rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_local_block_attention_equals_the_full_mask_twin(target, causal):
    drafter = tiny_drafter(target, "dflash2", block_size=4, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"])
    for layer in drafter.layers:
        layer.self_attn.causal = causal
    drafter.target = FrozenParts.from_target(target)
    batch = _batch(target, drafter.config.vocab_size, S=2, T=16, A=5)
    args = (batch.hidden, batch.valid_ctx, batch.anchor_tokens, batch.anchors)
    fast = training_hidden(drafter, *args, local=True)
    slow = training_hidden(drafter, *args, local=False)
    np.testing.assert_allclose(np.array(fast), np.array(slow), rtol=1e-4, atol=1e-5)
    g_fast = nn.value_and_grad(drafter, lambda: training_hidden(drafter, *args, local=True).sum())()[1]
    g_slow = nn.value_and_grad(drafter, lambda: training_hidden(drafter, *args, local=False).sum())()[1]
    for (k, a), (_, b) in zip(tree_flatten(g_fast), tree_flatten(g_slow)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=1e-3, err_msg=k)


def test_chain_labels_stop_at_the_first_text_token_off_the_targets_path(tmp_path):
    # tokens 10..19; the target's argmax agrees with the text except after position 4
    tokens = np.arange(10, 20, dtype=np.int32)
    labels = np.concatenate([tokens[1:], [0]]).astype(np.int32)
    labels[4] = 99  # the target would not have written token 15 after 14
    arrays = {"tokens": mx.array(tokens), "offsets": mx.array(np.array([0, 10], np.int64)),
              "response_start": mx.array(np.array([0], np.int32)), "hidden": mx.zeros((10, 3 * 64), mx.float16),
              "labels": mx.array(labels), "anchor_ok": mx.ones((10,), mx.uint8)}
    mx.save_safetensors(str(tmp_path / "tf-00000.safetensors"), arrays)
    for chain in (True, False):
        data = FeatureDataset([tmp_path / "tf-00000.safetensors"], chain_labels=chain)
        batch = data.batch([(0, np.arange(10))], block_size=5, n_anchors=10)
        for t, lab, m in zip(np.array(batch.anchors)[0], np.array(batch.labels)[0], np.array(batch.label_mask)[0]):
            for c in range(4):
                pos = t + c
                on_path = all(tokens[p] == labels[p - 1] for p in range(t + 1, min(pos, 9) + 1))
                assert bool(m[c]) == (pos < 10 and (on_path or not chain)), (chain, t, c)
                if m[c]:
                    assert lab[c] == labels[pos]


def test_export_carries_the_train_vocab(tmp_path):
    from dflash2_mlx.drafter.load import save_drafter
    from dflash2_mlx.train.export import export_drafter

    target = tiny_target("llama")
    run = tmp_path / "run"
    save_drafter(tiny_drafter(target, "dflash2", block_size=4), run / "checkpoint" / "drafter")
    (run / "proposal_vocab.json").write_text('{"format": "x"}')
    out = export_drafter(run / "checkpoint", tmp_path / "out")
    assert (out / "proposal_vocab.json").read_text() == '{"format": "x"}'


@pytest.mark.parametrize("segments, problem", [("9-6", "9-6"), ("6,x", "6,x"), ("7", "applies to --rebuild-features")])
def test_prepare_data_names_a_bad_segment_choice(tmp_path, segments, problem):
    args = ["train", "prepare-data", "--out", str(tmp_path / "d"), "--segments", segments]
    args += ["--rebuild-features"] if problem != "applies to --rebuild-features" else []
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert problem in result.stderr and not (tmp_path / "d").exists()
