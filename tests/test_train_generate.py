"""On-policy data: what the continuous batch captures equals plain decoding and the teacher-forced
extraction pass; runs resume bit for bit; feature shards rebuild from the committed tokens."""

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx import generate
from dflash2_mlx.train import onpolicy
from dflash2_mlx.train.data import target_pass
from dflash2_mlx.train.generate import CaptureGenerator, top_logprobs
from dflash2_mlx.train.shards import FeatureShard

from tiny import tiny_target

TAPS = (0, 2, 3)
PROMPTS = [[1, 5, 9, 13], [1, 40, 41], [1, 7, 7, 7, 7, 7, 7, 7, 8], [1, 60], [1, 22, 23, 24, 25, 26],
           [1, 3, 30, 33], [1, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79], [1, 11]]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param, eos=(17, 69, 90))


def _captured(target, batch_size=3, max_new=12):
    gen = CaptureGenerator(target, TAPS, batch_size=batch_size, join_min=2, max_new_tokens=max_new, top_k=8)
    return sorted(gen.run(list(enumerate(PROMPTS))), key=lambda g: g.index)


def test_captured_answers_are_plain_greedy_decoding(target):
    out = _captured(target)
    assert [g.index for g in out] == list(range(len(PROMPTS)))
    for g in out:
        plain = generate(target, g.prompt, max_tokens=12).tokens
        picked = g.response + [g.next_token]
        # plain decoding stops before EOS; the capture keeps EOS as the last label
        assert plain == (picked[:-1] if g.finish == "stop" else picked), g.index
        assert g.finish == ("stop" if g.next_token in (17, 69, 90) else "length")
    assert any(g.finish == "stop" for g in out) and any(g.finish == "length" for g in out)


def test_captured_features_equal_the_extraction_pass(target):
    for g in _captured(target):
        labels, h, ids, lps = target_pass(target, g.tokens, TAPS, top_k=8)
        n = len(g.prompt)
        assert np.array(labels)[n - 1 :].tolist() == g.labels
        np.testing.assert_allclose(g.hidden.astype(np.float32), np.array(h).astype(np.float32), rtol=2e-3, atol=2e-3)
        assert g.hidden.shape == (len(g.tokens), len(TAPS) * 64) and g.hidden.dtype == np.float16
        np.testing.assert_array_equal(g.top_ids, np.array(ids)[n - 1 :])
        np.testing.assert_allclose(g.top_logprobs.astype(np.float32), np.array(lps)[n - 1 :], atol=2e-2)
        assert (g.top_ids[:, 0] == np.array(g.labels)).all()


def test_batch_size_does_not_change_the_answers(target):
    one = _captured(target, batch_size=1)
    many = _captured(target, batch_size=8)
    for a, b in zip(one, many):
        assert a.response == b.response and a.next_token == b.next_token
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32), atol=2e-3)


def test_top_logprobs_are_the_best_k_in_order():
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32))
    ids, lps = top_logprobs(logits, 5)
    ref = np.array(logits) - np.log(np.exp(np.array(logits)).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.array(ids), np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(np.array(lps), np.sort(ref, axis=-1)[:, ::-1][:, :5], rtol=1e-5)


def _run(target, out, prompts, **kw):
    settings = {"taps": list(TAPS), "n": len(PROMPTS)}
    prompts = onpolicy.start_run(out, settings, prompts)
    return onpolicy.generate_run(target, out, prompts, TAPS, segment_size=3, batch_size=2, max_new_tokens=10,
                                 top_k=8, part_size=2, progress=False, **kw)


def _prompt_rows():
    return [{"i": i, "source": "test", "ids": ids} for i, ids in enumerate(PROMPTS)]


def test_resumed_run_is_bit_identical(target, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run(target, full, _prompt_rows())
    _run(target, cut, _prompt_rows())
    # A kill inside segment 1: its token file is missing and one of its shards is stale.
    onpolicy.token_path(cut, 1).unlink()
    for path in (cut / "feat").glob("onp-00001-*"):
        path.write_bytes(b"partial")
    totals = _run(target, cut, None)
    assert totals["segments"] == 1 and totals["prompts"] == 3
    names = sorted(p.name for p in (full / "feat").glob("*.safetensors"))
    assert names == sorted(p.name for p in (cut / "feat").glob("*.safetensors")) and len(names) == 5
    for name in names + ["../tokens/seg-00001.jsonl.gz"]:
        assert (full / "feat" / name).read_bytes() == (cut / "feat" / name).read_bytes(), name
    assert len((cut / "progress.jsonl").read_text().splitlines()) == 4  # 3 segments + the redone one


def test_a_resume_with_other_settings_is_refused(target, tmp_path):
    onpolicy.start_run(tmp_path, {"taps": [0, 2]}, _prompt_rows())
    with pytest.raises(Exception, match="taps"):
        onpolicy.start_run(tmp_path, {"taps": [0, 3]}, None)


def test_features_rebuilt_from_tokens_equal_the_captured_ones(target, tmp_path):
    _run(target, tmp_path, _prompt_rows())
    captured = {p.name: FeatureShard.load(p) for p in sorted((tmp_path / "feat").glob("*.safetensors"))}
    for path in (tmp_path / "feat").glob("onp-*.safetensors"):
        path.rename(path.with_suffix(".captured"))
    rebuilt = onpolicy.rebuild_features(target, tmp_path, TAPS, top_k=8, part_size=2, progress=False)
    assert sorted(p.name for p in rebuilt) == sorted(captured)
    for path in rebuilt:
        a, b = captured[path.name], FeatureShard.load(path)
        for field in ("tokens", "offsets", "response_start", "labels", "anchor_ok", "top_ids", "prompt_index"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32), atol=2e-3)
        np.testing.assert_allclose(a.top_logprobs.astype(np.float32), b.top_logprobs.astype(np.float32), atol=2e-2)
        soft = np.isfinite(a.top_logprobs[:, 0].astype(np.float32))
        # soft labels exist exactly from each sequence's last prompt position on
        for i in range(len(a)):
            s, e = a.offsets[i], a.offsets[i + 1]
            assert soft[s:e].tolist() == [j >= a.response_start[i] - 1 for j in range(e - s)]


def test_a_rebuild_limited_to_some_segments_remakes_only_theirs(target, tmp_path):
    _run(target, tmp_path, _prompt_rows())  # 8 prompts in segments of 3: segments 0, 1, 2
    for path in (tmp_path / "feat").glob("onp-*.safetensors"):
        path.unlink()
    rebuilt = onpolicy.rebuild_features(target, tmp_path, TAPS, top_k=8, part_size=2, progress=False, only={1, 2})
    assert sorted({p.name[:9] for p in rebuilt}) == ["onp-00001", "onp-00002"]
    assert not list((tmp_path / "feat").glob("onp-00000-*"))
