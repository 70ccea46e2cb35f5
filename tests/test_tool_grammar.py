"""Forced tool calls in each call format the server can constrain (json_tools, qwen3_coder,
pythonic): calls rendered the way chat templates render them pass the grammar and parse back
to the same arguments with mlx-lm's own parser; wrong names, missing required keys and
mistyped values are refused; a tiny model forced by the grammar, with and without speculation,
writes a call the parser reads."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from dflash2_mlx import generate
from dflash2_mlx.core.constraint import GrammarConstraint
from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.tool_grammar import FORMATS, call_format, forced_call_grammar
from dflash2_mlx.target import Target

from tiny import tiny_drafter, tiny_model

pytest.importorskip("llguidance")

WEATHER = {"name": "weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"}}}}
SEARCH = {"name": "search", "parameters": {
    "type": "object", "required": ["query", "filters"],
    "properties": {"query": {"type": "string"},
                   "filters": {"type": "object", "properties": {"lang": {"type": "string"}},
                               "required": ["lang"], "additionalProperties": False}}}}
PING = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, SEARCH, PING)]
EOS = 2
N_VOCAB = 3 + 256 + 2  # specials, bytes, the two call markers


def byte_tokenizer(fmt: str):
    """A real byte-level tokenizer over all 256 bytes, the format's call markers as added tokens,
    wrapped by mlx-lm with that format's parser (as mlx-lm infers it from a chat template)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    module = importlib.import_module(f"mlx_lm.tool_parsers.{fmt}")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.add_tokens([AddedToken(m, normalized=False, special=False)
                    for m in (module.tool_call_start, module.tool_call_end)])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", "isolated")])
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return TokenizerWrapper(hf, tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
                            tool_parser=module.parse_tool_call)


def render(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the model's chat template writes them (the templates' rules, per format)."""
    tok = importlib.import_module(f"mlx_lm.tool_parsers.{fmt}")
    if fmt == "json_tools":
        return "\n".join(f"{tok.tool_call_start}\n{json.dumps({'name': n, 'arguments': a})}\n{tok.tool_call_end}"
                         for n, a in calls)
    if fmt == "qwen3_coder":  # strings raw; mappings / lists tojson; other scalars as JSON here
        def value(v):
            return v if isinstance(v, str) else json.dumps(v)
        return "\n".join(f"{tok.tool_call_start}\n<function={n}>\n"
                         + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
                         + f"</function>\n{tok.tool_call_end}" for n, a in calls)
    inner = ", ".join(f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")" for n, a in calls)
    return f"{tok.tool_call_start}[{inner}]{tok.tool_call_end}"


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether `text` is a complete sentence of the grammar (every token allowed, then EOS)."""
    constraint = GrammarConstraint(tokenizer, N_VOCAB, [EOS], grammar)
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not constraint.masks([])[0][t]:
            return False
        constraint.consume([t])
    return bool(constraint.masks([])[0][EOS])


def parse(tokenizer, text: str, tools: list[dict] = TOOLS) -> list[dict]:
    """mlx-lm's parse of every call in `text`, as the server's ToolCallStream does."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    calls = []
    for chunk in text.split(start)[1:]:
        found = tokenizer.tool_parser(chunk.split(end)[0], tools)
        calls.extend(found if isinstance(found, list) else [found])
    return calls


GOOD = [
    [("weather", {"city": "Paris"})],
    [("weather", {"city": "New York\n</param", "days": 3, "unit": "f", "hourly": True})],
    [("search", {"query": "mlx \"dflash\"", "filters": {"lang": "en"}})],
    [("ping", {})],
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("calls", GOOD, ids=range(len(GOOD)))
def test_a_rendered_call_is_accepted_and_parses_back(fmt, calls):
    tokenizer = byte_tokenizer(fmt)
    assert call_format(tokenizer) == fmt
    text = render(fmt, calls)
    assert accepts(tokenizer, forced_call_grammar(tokenizer, TOOLS, "required", False, "m"), text)
    assert accepts(tokenizer, forced_call_grammar(tokenizer, TOOLS, calls[0][0], False, "m"), text)
    assert [(c["name"], c["arguments"]) for c in parse(tokenizer, text)] == calls


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pythonic"])
@pytest.mark.parametrize("parallel", [False, True])
def test_a_newline_after_the_last_call_may_end_the_reply(fmt, parallel):
    """Qwen2.5 writes a newline after each call and then ends: the grammar must let it end there,
    not force another call (which looped until max_tokens)."""
    tokenizer = byte_tokenizer(fmt)
    grammar = forced_call_grammar(tokenizer, TOOLS, "required", parallel, "m")
    one = render(fmt, [("weather", {"city": "Oslo"})])
    assert accepts(tokenizer, grammar, one + "\n")
    assert not accepts(tokenizer, grammar, one + "\n\n")
    two = render(fmt, [("weather", {"city": "Oslo"}), ("ping", {})])
    assert accepts(tokenizer, grammar, two + "\n") == parallel


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_calls_only_when_allowed(fmt):
    tokenizer = byte_tokenizer(fmt)
    calls = [("weather", {"city": "Oslo"}), ("ping", {})]
    text = render(fmt, calls)
    assert accepts(tokenizer, forced_call_grammar(tokenizer, TOOLS, "required", True, "m"), text)
    assert not accepts(tokenizer, forced_call_grammar(tokenizer, TOOLS, "required", False, "m"), text)
    assert [(c["name"], c["arguments"]) for c in parse(tokenizer, text)] == calls


BAD = {
    "unknown tool": [("wether", {"city": "Paris"})],
    "missing required key": [("weather", {"days": 3})],
    "integer as text": [("weather", {"city": "Paris", "days": "three"})],
    "value outside the enum": [("weather", {"city": "Paris", "unit": "k"})],
    "nested required key missing": [("search", {"query": "q", "filters": {}})],
    "undeclared key": [("weather", {"city": "Paris", "color": "red"})],
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", BAD)
def test_a_call_off_the_schema_is_refused(fmt, case):
    tokenizer = byte_tokenizer(fmt)
    grammar = forced_call_grammar(tokenizer, TOOLS, "required", True, "m")
    assert not accepts(tokenizer, grammar, render(fmt, BAD[case]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_choice_refuses_the_other_tools(fmt):
    tokenizer = byte_tokenizer(fmt)
    grammar = forced_call_grammar(tokenizer, TOOLS, "ping", False, "m")
    assert not accepts(tokenizer, grammar, render(fmt, [("weather", {"city": "Paris"})]))
    assert not accepts(tokenizer, grammar, "plain text")


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_but_valid_schemas_compile(fmt):
    tokenizer = byte_tokenizer(fmt)
    odd = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ['say "hi"'],
        "properties": {'say "hi"': {"type": ["string", "null"]}, "mood": {"enum": ["é", "ü"]}}}}}]
    grammar = forced_call_grammar(tokenizer, odd, "required", False, "m")
    if fmt == "qwen3_coder":  # a nullable string is raw text; non-ASCII enum values are literals
        assert accepts(tokenizer, grammar, render(fmt, [("note", {'say "hi"': "yes", "mood": "é"})]))


def test_malformed_parameters_are_a_config_error():
    from dflash2_mlx.errors import ConfigError

    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}]
    with pytest.raises(ConfigError, match="parameters.properties must be an object"):
        forced_call_grammar(byte_tokenizer("qwen3_coder"), bad, "required", False, "m")


def test_an_unsupported_format_is_a_400_naming_it():
    tokenizer = byte_tokenizer("mistral")
    with pytest.raises(APIError) as e:
        forced_call_grammar(tokenizer, TOOLS, "required", False, "tiny-mistral")
    assert e.value.status == 400 and "'mistral'" in str(e.value) and "'tiny-mistral'" in str(e.value)


# Closed arguments (an enum and a boolean), so a random model forced by the grammar ends.
CLOSED = [{"type": "function", "function": {"name": "light", "parameters": {
    "type": "object", "required": ["room", "on"],
    "properties": {"room": {"type": "string", "enum": ["hall", "kitchen"]}, "on": {"type": "boolean"}}}}}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_tiny_model_writes_a_call_the_parser_reads(fmt):
    tokenizer = byte_tokenizer(fmt)
    tokenizer._eos_token_ids = {EOS}
    target = Target(tiny_model("llama", vocab_size=N_VOCAB), tokenizer, path="tiny-tools")
    grammar = forced_call_grammar(tokenizer, CLOSED, "light", False, "m")

    def run(drafter=None):
        constraint = GrammarConstraint(tokenizer, N_VOCAB, [EOS], grammar)
        return generate(target, [1, 40, 41], max_tokens=120, drafter=drafter, block_size=4, constraint=constraint)

    plain = run()
    spec = run(tiny_drafter(target, "dflash2", block_size=4, vocab_size=N_VOCAB))
    assert spec.tokens == plain.tokens and plain.finish_reason == "stop"
    text = tokenizer.decode([t for t in plain.tokens if t != EOS])
    [call] = parse(tokenizer, text, CLOSED)
    assert call["name"] == "light" and call["arguments"]["room"] in ("hall", "kitchen")
    assert isinstance(call["arguments"]["on"], bool)
    assert np.any([c.n_drafted for c in spec.cycles])


# -- calls without markers (small json_tools models) ------------------------------------------

BARE = '{"name": "weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("reply", [BARE, f"  {BARE}\n", f"```json\n{BARE}\n```", f"[{BARE}, {BARE}]"])
def test_a_reply_that_is_only_a_call_becomes_a_call(reply):
    from dflash2_mlx.server.tools import CallCollector

    collector = CallCollector(byte_tokenizer("json_tools"), TOOLS)
    shown = [collector.feed(reply[i:i + 3])[0] for i in range(0, len(reply), 3)]  # streamed in pieces
    rest, calls = collector.finish()
    assert "".join(shown) + rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("weather", {"city": "Paris"})] * reply.count('"name"')
    assert collector.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("reply", [
    '{"name": "nobody", "arguments": {}}',                       # not a given tool
    '{"name": "weather", "arguments": {"city": "Paris"}} ok',     # more than the call
    '{"name": "weather", "arguments": "Paris"}',                  # arguments not an object
    '{"name": "weather", "arguments": {}, "extra": 1}',
    "```python\nprint(1)\n```",                                  # a code answer streams at once
    "The weather tool needs a city.",
])
def test_any_other_reply_is_content_as_written(reply):
    from dflash2_mlx.server.tools import CallCollector

    collector = CallCollector(byte_tokenizer("json_tools"), TOOLS)
    shown = "".join(collector.feed(reply[i:i + 3])[0] for i in range(0, len(reply), 3))
    rest, calls = collector.finish()
    assert shown + rest == reply and calls == []
    if not reply.startswith("{"):
        assert shown  # not held back until the end


def test_bare_calls_only_for_the_json_format():
    from dflash2_mlx.server.tools import CallCollector

    collector = CallCollector(byte_tokenizer("qwen3_coder"), TOOLS)
    assert collector.feed(BARE)[0] == BARE and collector.finish() == ("", [])
