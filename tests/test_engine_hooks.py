"""Engine hooks the server relies on: a cancellable chunked prefill, and no U+FFFD at a cut."""

from dflash2_mlx import generate, stream_generate

from tiny import tiny_drafter, tiny_target

PROMPT = [1, 40, 41, 42, 7, 19, 33, 60, 61, 5, 8]


def test_on_prefill_sees_every_chunk_and_keeps_the_output():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    calls = []
    hooked = generate(target, PROMPT, drafter=drafter, max_tokens=12, prefill_step_size=4,
                      on_prefill=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 11), (4, 11), (8, 11), (10, 11)]  # the last token is a pass of its own
    assert hooked.tokens == generate(target, PROMPT, drafter=drafter, max_tokens=12).tokens


def test_on_prefill_false_cancels_before_any_token():
    target = tiny_target("llama")
    calls = []

    def stop_at_second_chunk(done, total):
        calls.append(done)
        return done < 4

    events = list(stream_generate(target, PROMPT, max_tokens=8, prefill_step_size=4,
                                  on_prefill=stop_at_second_chunk))
    assert events == [] and calls == [0, 4]


def _byte_fallback_tokenizer():
    """Letters plus the two bytes of 'é' (C3 A9) as byte-fallback tokens."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "a": 2, "b": 3, "<0xC3>": 4, "<0xA9>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>"))


def test_a_cut_mid_character_emits_no_replacement_character():
    from dflash2_mlx.core.stopper import Stopper

    tok = _byte_fallback_tokenizer()
    whole = Stopper(tok, {1}, [], max_tokens=10)
    whole.feed([2, 4, 5, 3])
    assert whole.new_text(final=True) == "aéb"  # a complete 'é' decodes as itself
    cut = Stopper(tok, {1}, [], max_tokens=2)
    kept, finish = cut.feed([2, 4, 5, 3])
    assert (kept, finish) == ([2, 4], "length")
    assert cut.new_text(final=True) == "a"


def test_control_tokens_stay_out_of_the_text_and_tool_markers_stay_in():
    """<|im_start|> leaked into a Codex answer; vLLM and llama.cpp leave control tokens out."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken

    from dflash2_mlx.core.stopper import Stopper, unrendered_tokens

    from tiny import TinyTokenizer

    names = ["<|im_start|>", "<tool_call>", "</tool_call>", "<x>"]
    hf = TinyTokenizer.make(wrap=False)
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in names[:3]], special_tokens=True)
    hf.add_tokens([AddedToken(names[3], special=False, normalized=False)])
    start, call, end, x = hf.convert_tokens_to_ids(names)
    tok = TokenizerWrapper(hf, tool_call_start="<tool_call>", tool_call_end="</tool_call>")
    hidden = unrendered_tokens(tok)  # <x> is not special; the tool markers are parsed from the text
    assert hidden[start] == "<|im_start|>" and not {call, end, x} & set(hidden)
    ids = tok.encode("Hi", add_special_tokens=False)
    stopper = Stopper(tok, set(), [], max_tokens=20)
    kept, finish = stopper.feed(ids + [start, call] + ids + [end, x])
    assert finish is None and len(kept) == 2 * len(ids) + 4  # hidden tokens still count
    assert stopper.new_text(final=True) == "Hi<tool_call>Hi</tool_call><x>"
    # a stop string spelled as the control token still stops the reply there
    stopper = Stopper(tok, set(), ["<|im_start|>"], max_tokens=20)
    assert stopper.feed(ids + [start] + ids) == (ids + [start], "stop")
    assert stopper.matched == "<|im_start|>" and stopper.new_text(final=True) == "Hi"


def test_pipelined_plain_decoding_equals_the_step_by_step_twin():
    from dflash2_mlx import SamplingParams

    for family in ("llama", "qwen3_5", "gemma3_text"):
        target = tiny_target(family)
        for sampling in (None, SamplingParams(temperature=0.8, seed=3)):
            fast = generate(target, PROMPT, max_tokens=40, sampling=sampling)
            slow = generate(target, PROMPT, max_tokens=40, sampling=sampling, pipelined=False)
            assert fast.tokens == slow.tokens and len(fast.tokens) == 40, family
            assert [c.width for c in fast.cycles] == [1] * 39



class ScriptedWidths:
    """A block policy replaying a fixed width pattern, whatever it observes."""

    def __init__(self, pattern):
        self.pattern, self.i, self.seen = pattern, 0, []

    def begin(self):
        self.seen.append("begin")

    def next_width(self, max_width):
        w = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return min(w, max_width)

    def observe(self, cycle):
        self.seen.append(cycle.width)


def test_each_reply_begins_the_policy_once_before_its_first_width():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    policy = ScriptedWidths([1, 3])
    for _ in range(2):
        generate(target, PROMPT, drafter=drafter, max_tokens=12, block_size=4, block_policy=policy)
    begins = [i for i, x in enumerate(policy.seen) if x == "begin"]
    assert len(begins) == 2 and begins[0] == 0 and policy.seen[begins[1] - 1] != "begin"


def test_pipelined_plain_steps_between_speculative_ones_equal_the_twin():
    from dflash2_mlx import SamplingParams

    pattern = [1, 1, 3, 1, 4, 4, 1, 1, 1, 2]
    for family in ("llama", "qwen3_5", "gemma3_text"):
        target = tiny_target(family)
        drafter = tiny_drafter(target, "dflash2", block_size=4, sliding_window=12)
        for sampling in (None, SamplingParams(temperature=0.8, seed=5)):
            runs = [generate(target, PROMPT, drafter=drafter, max_tokens=40, sampling=sampling, block_size=4,
                             block_policy=ScriptedWidths(pattern), pipelined=p) for p in (True, False)]
            assert runs[0].tokens == runs[1].tokens, (family, sampling)
            assert [c.width for c in runs[0].cycles] == [c.width for c in runs[1].cycles]
        assert {c.width for c in runs[0].cycles} == {1, 2, 3, 4}


def test_penalties_read_only_their_window_of_a_long_history():
    import mlx.core as mx

    from dflash2_mlx import SamplingParams
    from dflash2_mlx.core.sampling import make_processors, process_rows

    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, penalty_context=20)
    history = [(7 * i) % 90 + 3 for i in range(500)]
    logits = mx.random.normal((4, 97), key=mx.random.key(0))
    block = [5, 9, 9]
    full = process_rows(logits, history, block, make_processors(params))
    windowed = process_rows(logits, history, block, make_processors(params), window=params.penalty_context)
    assert mx.array_equal(full, windowed)
    plain = process_rows(logits, history, block, [])
    assert not mx.array_equal(full, plain)  # the penalties did act


def _true_logprobs(target, ids, tokens):
    """log-softmax of one full forward over prompt + tokens: each emitted token's truth."""
    import mlx.core as mx

    logits = target.model(mx.array([ids + tokens]))[0, len(ids) - 1 : len(ids) - 1 + len(tokens)]
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    return lp


def test_logprobs_are_the_targets_own_under_speculation():
    import mlx.core as mx

    from dflash2_mlx import SamplingParams

    for family in ("llama", "qwen3_5"):
        target = tiny_target(family)
        drafter = tiny_drafter(target, "dflash2", block_size=4, sliding_window=12)
        for sampling in (None, SamplingParams(temperature=0.9, seed=2)):
            for d in (None, drafter):
                events = list(stream_generate(target, PROMPT, drafter=d, max_tokens=24, sampling=sampling,
                                              top_logprobs=3))
                tokens = [t for e in events for t in e.tokens]
                lps = [lp for e in events for lp in e.logprobs]
                assert [lp.token for lp in lps] == tokens and len(tokens) == 24
                truth = _true_logprobs(target, PROMPT, tokens)
                for i, lp in enumerate(lps):
                    assert abs(lp.logprob - truth[i, lp.token].item()) < 1e-4, (family, d is None, i)
                    assert [t for t, _ in lp.top] == mx.argsort(-truth[i])[:3].tolist()
                    assert lp.top[0][1] >= lp.logprob - 1e-6
            if sampling is None:  # greedy: the top alternative is the token itself
                assert all(lp.top[0][0] == lp.token for lp in lps)
    assert all(e.logprobs is None for e in stream_generate(target, PROMPT, drafter=drafter, max_tokens=8))


def test_overlapped_and_synchronous_drafting_emit_the_same_tokens():
    from dflash2_mlx import SamplingParams

    target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target, "dflash2", block_size=5, sliding_window=12)
    for sampling in (None, SamplingParams(temperature=0.7, seed=9)):
        runs = [generate(target, PROMPT, drafter=drafter, max_tokens=30, sampling=sampling, overlap=o)
                for o in (True, False)]
        assert runs[0].tokens == runs[1].tokens and runs[0].speculative_cycles
