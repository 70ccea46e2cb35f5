"""The decoding loop: speculative output equals plain decoding, token for token."""

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache

from dflash2_mlx import SamplingParams, generate, stream_generate
from dflash2_mlx.drafter.context import DraftContext
from dflash2_mlx.drafter.selector import Proposal
from dflash2_mlx.errors import ConfigError

from tiny import FAMILIES, MASK_ID, VOCAB, tiny_drafter, tiny_target

PROMPT = [1, 40, 41, 42, 7, 19, 33, 60, 61, 5, 8]
N_TOKENS = 48  # > 4x the gemma window of 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_target(request):
    target = tiny_target(request.param)
    return request.param, target, generate(target, PROMPT, max_tokens=N_TOKENS).tokens


def test_plain_decoding_equals_mlx_lm(family_target):
    family, target, ours = family_target
    tokens = []
    for response in mlx_stream_generate(target.model, target.tokenizer, mx.array(PROMPT), max_tokens=N_TOKENS,
                                        prompt_cache=make_prompt_cache(target.model)):
        if response.finish_reason != "stop" or response.token not in target.eos_token_ids:
            tokens.append(response.token)
    assert ours == tokens[: len(ours)] and len(ours) >= min(len(tokens), N_TOKENS)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("block_size", [2, 3, 5, 8, 16])
def test_greedy_speculative_equals_plain(family_target, arch, block_size):
    family, target, plain = family_target
    drafter = tiny_drafter(target, arch, block_size=block_size, sliding_window=12)
    result = generate(target, PROMPT, drafter=drafter, max_tokens=N_TOKENS)
    assert result.tokens == plain
    assert all(c.width <= block_size for c in result.cycles)


class ScriptedDrafter:
    """Proposes the true continuation with one token corrupted per block, at a depth that
    cycles through 0..width-1 (and 'none'), so every acceptance length occurs."""

    def __init__(self, target, truth, block_size):
        from dflash2_mlx.drafter.config import parse_config

        from tiny import drafter_config_dict

        self.config = parse_config(drafter_config_dict("dflash", block_size=block_size, target_layers=(1,)))
        self.target, self.truth, self.n_ctx, self.calls = target, truth, 0, 0

    def begin(self, reserve=0):
        return DraftContext([], None)

    def draft(self, anchor, context, block_size, temperature=0.0, key=None):
        ctx = context.take()
        self.n_ctx += ctx.shape[1]
        pos = self.n_ctx  # index of the anchor in prompt + output
        drafts = list(self.truth[pos + 1 : pos + block_size])
        drafts += [3] * (block_size - 1 - len(drafts))
        bad = self.calls % (block_size + 1)
        if bad < block_size - 1:
            drafts[bad] = (drafts[bad] + 1) % VOCAB
        self.calls += 1
        return Proposal(tokens=mx.array([drafts], dtype=mx.int32))


@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_every_acceptance_depth_keeps_output_exact(family_target, block_size):
    family, target, plain = family_target
    drafter = ScriptedDrafter(target, PROMPT + plain + [3] * 32, block_size)
    result = generate(target, PROMPT, drafter=drafter, max_tokens=N_TOKENS)
    assert result.tokens == plain
    spec = result.speculative_cycles
    assert len(plain) == N_TOKENS and len(set(plain)) > 10
    assert {c.n_accepted for c in spec} == set(range(block_size))
    assert result.tau == pytest.approx(sum(c.n_accepted + 1 for c in spec) / len(spec))


def test_mask_token_is_an_ordinary_token():
    target = tiny_target("qwen3")
    truth = [MASK_ID] * 40
    drafter = ScriptedDrafter(target, truth, 4)
    # A target that always answers MASK_ID: bias the head hugely towards it.
    head = target.model.lm_head
    head.weight = head.weight.at[MASK_ID].add(50.0 * mx.sign(mx.ones((head.weight.shape[1],))))
    plain = generate(target, [1, 2, 5], max_tokens=12)
    assert MASK_ID in plain.tokens
    drafter.truth = [1, 2, 5] + plain.tokens + [3] * 20
    spec = generate(target, [1, 2, 5], drafter=drafter, max_tokens=12)
    assert spec.tokens == plain.tokens


def test_stops_on_eos_stop_string_and_max_tokens():
    target = tiny_target("llama", seed=3)
    free = generate(target, PROMPT, max_tokens=30)
    assert len(free.tokens) <= 30
    text = free.text
    assert len(free.tokens) == 30 and len(text) > 12
    stop = text[8:11]
    cut = generate(target, PROMPT, drafter=tiny_drafter(target, "dflash2"), max_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    eos = free.tokens[4]
    target.tokenizer._eos_token_ids = {eos}
    stopped = generate(target, PROMPT, drafter=tiny_drafter(target, "dflash"), max_tokens=30)
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[: free.tokens.index(eos)]
    one = generate(target, PROMPT, max_tokens=1)
    assert one.finish_reason in ("length", "stop") and len(one.tokens) <= 1


def test_sampling_is_repeatable_with_a_seed():
    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, "dflash2")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    a = generate(target, PROMPT, drafter=drafter, max_tokens=20, sampling=params)
    b = generate(target, PROMPT, drafter=drafter, max_tokens=20, sampling=params)
    c = generate(target, PROMPT, drafter=drafter, max_tokens=20, sampling=SamplingParams(temperature=0.9, seed=8))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_penalties_apply_identically_with_and_without_speculation():
    target = tiny_target("qwen3")
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2)
    plain = generate(target, PROMPT, max_tokens=30, sampling=params)
    truth = PROMPT + plain.tokens + [3] * 20
    spec = generate(target, PROMPT, drafter=ScriptedDrafter(target, truth, 5), max_tokens=30, sampling=params)
    assert spec.tokens == plain.tokens
    assert plain.tokens != generate(target, PROMPT, max_tokens=30).tokens


def test_events_stream_text_and_stats():
    target = tiny_target("llama")
    events = list(stream_generate(target, PROMPT, drafter=tiny_drafter(target, "dflash2"), max_tokens=10, block_size=4))
    assert events[0].cycle is None and all(e.cycle is not None for e in events[1:])
    assert events[-1].finish_reason is not None
    assert sum(len(e.tokens) for e in events) == events[-1].generation_tokens


def test_bad_arguments_fail_with_values():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash")
    with pytest.raises(ConfigError, match="max_tokens must be >= 1, got 0"):
        generate(target, PROMPT, max_tokens=0)
    with pytest.raises(ConfigError, match="block_size must be >= 2.*got 1"):
        generate(target, PROMPT, drafter=drafter, block_size=1)
    with pytest.raises(ConfigError, match=r"\[500\] are outside the vocab \(size 97\)"):
        generate(target, [1, 500])
    with pytest.raises(ConfigError, match="temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_quantized_kv_cache_rolls_back_exactly():
    target = tiny_target("llama", head_dim=32)
    plain = generate(target, PROMPT, max_tokens=32, kv_bits=8)
    spec = generate(target, PROMPT, drafter=tiny_drafter(target, "dflash2"), max_tokens=32, block_size=5, kv_bits=8)
    truth = PROMPT + plain.tokens + [3] * 16
    scripted = generate(target, PROMPT, drafter=ScriptedDrafter(target, truth, 6), max_tokens=32, kv_bits=8)
    assert spec.tokens == plain.tokens == scripted.tokens
    assert {c.n_accepted for c in scripted.speculative_cycles} == set(range(6))
    with pytest.raises(ConfigError, match="kv_bits must be 4 or 8, got 3"):
        generate(target, PROMPT, kv_bits=3)
    with pytest.raises(ConfigError, match="multiple of 32, got 16"):
        generate(tiny_target("llama"), PROMPT, kv_bits=8)


def _naive_stop(text, stops):
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


@pytest.mark.parametrize("stops", [["lo w"], ["xyz", "o w", "ld"], ["d!", "zz"], ["w"], ["nope"]])
def test_stop_search_equals_the_naive_search_and_reads_only_the_tail(monkeypatch, stops):
    from dflash2_mlx.core import stopper as stopper_module

    from tiny import TinyTokenizer

    window = []
    find = stopper_module.find_stop

    def spy(text, stop, start):
        window.append(len(text) - start)
        return find(text, stop, start)

    monkeypatch.setattr(stopper_module, "find_stop", spy)
    tok = TinyTokenizer.make()
    text = "hello world, hello world!"
    ids = tok.encode(text, add_special_tokens=False)  # one token per character: stops span tokens
    stopper = stopper_module.Stopper(tok, set(), stops, max_tokens=1000)
    kept, finish, pos = [], None, 0
    for size in [1, 3, 2, 5, 1, 4] * 5:  # chunks like the cycles of speculative decoding
        got, finish = stopper.feed(ids[pos : pos + size])
        kept, pos = kept + got, pos + size
        if finish or pos >= len(ids):
            break
    cut = _naive_stop(text, stops)
    n_keep = next((k for k in range(1, len(ids) + 1) if _naive_stop(tok.decode(ids[:k]), stops) >= 0), len(ids))
    assert (stopper.text, kept, finish) == (text if cut < 0 else text[:cut], ids[:n_keep],
                                            "stop" if cut >= 0 else None)
    assert window and max(window) <= 1  # the text added since the last search: one character


def test_generation_runs_inside_the_wired_limit_and_clears_the_cache_unchanged(monkeypatch):
    from contextlib import contextmanager

    from dflash2_mlx.core import batch_engine
    from dflash2_mlx.core import events as events_module

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    monkeypatch.setattr(batch_engine, "CLEAR_CACHE_EVERY", 10**9)
    baseline = generate(target, PROMPT, drafter=drafter, max_tokens=40)
    log, cleared, clear = [], [], mx.clear_cache

    @contextmanager
    def wired(model):
        log.append(("enter", model))
        yield
        log.append("exit")

    monkeypatch.setattr(batch_engine, "_wired_limit", wired)
    monkeypatch.setattr(batch_engine, "CLEAR_CACHE_EVERY", 2)
    monkeypatch.setattr(mx, "clear_cache", lambda: (cleared.append(1), clear())[1])
    events = stream_generate(target, PROMPT, drafter=drafter, max_tokens=40)
    first = next(events)
    assert log == [("enter", target.model)]  # entered before the prefill, still held
    result = events_module.collect([first, *events])
    assert log == [("enter", target.model), "exit"]
    assert result.tokens == baseline.tokens and result.text == baseline.text
    assert len(cleared) == len(result.cycles) // 2 > 0
