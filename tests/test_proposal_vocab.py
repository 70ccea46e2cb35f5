"""The compact proposal head: proposals equal the full head sliced to the subset, output stays exact."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash2_mlx import generate, load_drafter
from dflash2_mlx.drafter import model as drafter_model
from dflash2_mlx.drafter.vocab import (
    FILE_NAME,
    ProposalVocab,
    count_tokens,
    head_rows,
    rank_ids,
    read_vocab_file,
    resolve_vocab,
    write_vocab_file,
)
from dflash2_mlx.errors import ConfigError

from tiny import HIDDEN, MASK_ID, VOCAB, tiny_drafter, tiny_target

PROMPTS = [[1, 40, 41, 42, 7, 19], [1, 5, 8, 60, 61], [1, 33, 12, 70, 71, 72]]
SIZE = 40  # of the prime vocab 97: the drafter can propose well under half the ids


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def vocab(target):
    """A tiny frequency-ranked subset: counts of the target's own greedy outputs."""
    outs = [generate(target, p, max_tokens=32).tokens for p in PROMPTS]
    counts = count_tokens(outs, VOCAB)
    return ProposalVocab(tuple(rank_ids(counts, always=target.eos_token_ids)), VOCAB, SIZE, SIZE)


def _hidden(drafter, block_size=5, seed=3):
    """Final-normed draft states of one block after 6 context rows (the same each call)."""
    ctx = mx.random.normal((1, 6, 3 * HIDDEN), key=mx.random.key(seed))
    block = mx.array([[7] + [MASK_ID] * (block_size - 1)])
    return drafter.hidden_states(block, ctx, drafter.make_cache())[:, 1:]


def _propose(drafter, block_size=5, temperature=0.0, key=None, seed=3):
    ctx = mx.random.normal((1, 6, 3 * HIDDEN), key=mx.random.key(seed))
    return drafter.draft_from(mx.array([7]), ctx, drafter.make_cache(), block_size, temperature, key)


def test_vocab_ids_are_the_top_ranked_sorted(vocab, target):
    ids = np.array(vocab.ids)
    assert ids.size == SIZE and (np.diff(ids) > 0).all()
    assert set(ids) == set(vocab.ranked[:SIZE]) and target.eos_token_ids <= set(ids.tolist())


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_compact_greedy_proposals_equal_sliced_full_head(target, vocab, arch):
    drafter = tiny_drafter(target, arch)
    full = drafter.logits(_hidden(drafter))
    drafter.use_proposal_vocab(vocab)
    out = _propose(drafter)
    ids = vocab.ids
    sliced = full[..., ids]
    np.testing.assert_allclose(np.array(out.logits), np.array(sliced), rtol=1e-5, atol=1e-5)
    if arch == "dflash":
        ref = ids[mx.argmax(sliced, axis=-1)]
    else:
        h = _hidden(drafter)
        ref_prop = drafter.candidate_selector(h, sliced, mx.array([7]), 0.0, vocab_ids=ids)
        assert (np.array(out.candidates) == np.array(ref_prop.candidates)).all()
        assert set(np.array(out.candidates).ravel()) <= set(np.array(ids).tolist())
        ref = ref_prop.tokens
    assert np.array(out.tokens).tolist() == np.array(ref).tolist()
    assert set(np.array(out.tokens).ravel()) <= set(np.array(ids).tolist())


def test_sampled_q_is_a_distribution_over_the_subset(target, vocab):
    drafter = tiny_drafter(target, "dflash2")
    full = drafter.logits(_hidden(drafter))
    drafter.use_proposal_vocab(vocab)
    key = mx.random.key(11)
    out = _propose(drafter, temperature=0.8, key=key)
    ref = drafter.candidate_selector(_hidden(drafter), full[..., vocab.ids], mx.array([7]), 0.8, key,
                                     vocab_ids=vocab.ids)
    q = np.array(out.q)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(q, np.array(ref.q), atol=1e-5)
    assert np.array(out.tokens).tolist() == np.array(ref.tokens).tolist()
    assert set(np.array(out.candidates).ravel()) <= set(np.array(vocab.ids).tolist())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("arch,block_size", [("dflash", 4), ("dflash2", 3), ("dflash2", 6)])
def test_greedy_generation_identical_with_compact_head(family, arch, block_size):
    target = tiny_target(family)
    outs = [generate(target, p, max_tokens=32).tokens for p in PROMPTS]
    small = ProposalVocab(tuple(rank_ids(count_tokens(outs, VOCAB))), VOCAB, SIZE, SIZE)
    drafter = tiny_drafter(target, arch)
    drafter.use_proposal_vocab(small)
    for prompt, plain in zip(PROMPTS, outs):
        assert generate(target, prompt, drafter=drafter, max_tokens=32, block_size=block_size).tokens == plain


def test_full_head_logits_unchanged_by_the_compact_head(target, vocab):
    drafter = tiny_drafter(target, "dflash2")
    h = _hidden(drafter)
    before = np.array(drafter.logits(h))
    drafter.use_proposal_vocab(vocab)
    assert np.array_equal(np.array(drafter.logits(h)), before)  # diagnose and training read all V
    drafter.use_proposal_vocab(None)
    assert drafter._draft_head is None and drafter.proposal_logits(h)[1] is None


def test_quantized_compact_head_and_quantized_target_rows(target, vocab):
    drafter = tiny_drafter(target, "dflash2")
    drafter.use_proposal_vocab(vocab)
    assert drafter.quantize_head(8)
    assert isinstance(drafter._draft_head, nn.QuantizedLinear) and drafter._draft_head.weight.shape[0] == SIZE
    sliced = drafter.logits(_hidden(drafter))[..., vocab.ids]
    assert 0 < float(mx.abs(drafter.proposal_logits(_hidden(drafter))[0] - sliced).max()) < 0.5
    prompt = PROMPTS[0]
    assert (generate(target, prompt, drafter=drafter, max_tokens=24).tokens
            == generate(target, prompt, max_tokens=24).tokens)

    from dflash2_mlx.target import Target

    from tiny import TinyTokenizer, tiny_model

    model = tiny_model("llama")
    nn.quantize(model, group_size=64, bits=8)
    qt = Target(model, TinyTokenizer.make())
    assert qt.dense_head_weight is None and qt.quantized_head is not None
    rows = head_rows(qt, vocab.ids)
    x = mx.random.normal((1, 3, HIDDEN))
    np.testing.assert_allclose(np.array(rows(x)), np.array(qt.head(x)[..., vocab.ids]), rtol=1e-5, atol=1e-5)


def test_mask_is_built_once_per_layer_kind(target, monkeypatch):
    calls = []
    real = drafter_model.block_attention_mask
    monkeypatch.setattr(drafter_model, "block_attention_mask", lambda *a: calls.append(a) or real(*a))
    drafter = tiny_drafter(target, "dflash2", layer_types=["sliding_attention"] * 3, sliding_window=4)
    _propose(drafter)
    assert len(calls) == 1


# -- the file ----------------------------------------------------------------------------------


def test_vocab_file_round_trip_and_sizes(tmp_path):
    counts = np.arange(VOCAB)[::-1].copy()  # id 0 most frequent
    counts[5] = 0
    path = write_vocab_file(tmp_path / FILE_NAME, counts, keep=60, default_size=32, source={"corpus": "test"},
                            always=[90], heldout=counts)
    raw = json.loads(path.read_text())
    assert raw["ranked_ids"][:3] == [90, 0, 1] and 5 not in raw["ranked_ids"] and len(raw["ranked_ids"]) == 60
    assert raw["source"]["corpus"] == "test" and raw["coverage"]["60"] <= 1.0
    v = read_vocab_file(path)
    assert v.size == 32 and v.resized(50).size == 50
    with pytest.raises(ConfigError, match=r"1\.\.60"):
        v.resized(61)
    assert resolve_vocab(tmp_path, VOCAB, None).size == 32
    assert resolve_vocab(tmp_path, VOCAB, 0) is None and resolve_vocab(tmp_path, VOCAB, VOCAB) is None
    with pytest.raises(ConfigError, match="ranks a vocab of 97"):
        resolve_vocab(tmp_path, 100, None)
    with pytest.raises(ConfigError, match="needs a proposal_vocab.json"):
        resolve_vocab(tmp_path / "nowhere", VOCAB, 16)
    assert resolve_vocab(tmp_path / "nowhere", VOCAB, None) is None


def test_load_drafter_uses_the_shipped_file(pair, tmp_path):
    import shutil

    from dflash2_mlx.target import load_target

    target_dir, drafter_dir = pair
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    write_vocab_file(d / FILE_NAME, np.arange(VOCAB)[::-1].copy(), keep=64, default_size=48,
                     source={"corpus": "test"})
    target = load_target(target_dir)
    assert load_drafter(d, target).proposal_vocab.size == 48
    assert load_drafter(d, target, draft_vocab=20).proposal_vocab.size == 20
    assert load_drafter(d, target, draft_vocab=0).proposal_vocab is None
    assert load_drafter(drafter_dir, target).proposal_vocab is None


def test_build_draft_vocab_from_prepared_responses(tmp_path):
    from dflash2_mlx.train import onpolicy
    from dflash2_mlx.train.draft_vocab import build_draft_vocab, coverage_of

    onpolicy.write_jsonl_gz(tmp_path / onpolicy.PROMPTS_FILE, [{"i": 0, "ids": [1, 2]}, {"i": 1, "ids": [1]}])
    rows = [{"i": 0, "response": [7, 7, 7, 9, 9, 3], "next": 2, "finish": "stop"},
            {"i": 1, "response": [9, 11], "next": 5, "finish": "length"}]
    onpolicy.write_jsonl_gz(onpolicy.token_path(tmp_path, 0), rows)
    path = build_draft_vocab(None, VOCAB, tmp_path, n_conversations=0, data_dir=tmp_path, keep=8, default_size=4,
                             always=[2], target_name="tiny")
    raw = json.loads(path.read_text())
    assert raw["ranked_ids"][:5] == [2, 7, 9, 3, 11] and raw["default_size"] == 4
    assert raw["source"]["target_response_tokens"] == 8 and raw["source"]["tokenizer"] == "tiny"
    assert coverage_of(raw["ranked_ids"][:3], [r["response"] for r in rows]) == 6 / 8


def test_doctor_shows_the_compact_head(pair, tmp_path):
    import shutil

    from dflash2_mlx import doctor
    from dflash2_mlx.cli.doctor import _render_memory

    target_dir, drafter_dir = pair
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    plain = doctor.estimate_memory(str(target_dir), str(d), context=64)["drafter"]
    assert plain["proposal_vocab"] == {"active": False, "reason": "no proposal_vocab.json next to the drafter"}
    write_vocab_file(d / FILE_NAME, np.arange(VOCAB)[::-1].copy(), keep=64, default_size=48,
                     source={"built_by": "test"})
    mem = doctor.estimate_memory(str(target_dir), str(d), context=64)
    pv = mem["drafter"]["proposal_vocab"]
    assert pv["active"] and pv["size"] == 48 and pv["source"]["built_by"] == "test"
    assert mem["drafter"]["weights_bytes"] == plain["weights_bytes"] + 48 * HIDDEN * 4  # the private rows
    assert "compact head, 48 of 97 ids" in "\n".join(_render_memory(mem))
    off = doctor.estimate_memory(str(target_dir), str(d), context=64, draft_vocab=0)
    assert "--draft-vocab 0" in off["drafter"]["proposal_vocab"]["reason"]
