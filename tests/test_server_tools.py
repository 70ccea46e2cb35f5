"""Tool calls through a real `dflash2 serve` process, with the official SDKs: a tiny target
that always calls `weather` (tests/tool_model.py), the tools rendered by its chat template and
the call parsed by mlx-lm's `json_tools` parser; bad tool input is a 400 in each API's shape."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_harness import ServerProcess, request, write_pair

from tool_model import CALL, save_tool_pair

NAME = "tool-target"
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("toolpair"))
    log = tmp_path_factory.mktemp("logs") / "tools.log"
    with ServerProcess(*pair, "--block-size", "4", log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_tool_call_is_parsed_into_tool_calls(client):
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=16)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(client):
    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=16, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    first, *more = calls  # the id and name first, then the arguments as they are written
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == CALL["name"]
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in more)
    arguments = first.function.arguments + "".join(d.function.arguments for d in more)
    assert json.loads(arguments) == CALL["arguments"]


def test_without_tools_the_markup_is_plain_content(client):
    reply = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=16)
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert reply.choices[0].message.content == f"<tool_call>{json.dumps(CALL)}</tool_call>"
    none = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert none.choices[0].message.content == reply.choices[0].message.content


def test_tools_are_rendered_and_tool_results_accepted(client):
    plain = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # "Tools: weather\n" was rendered
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=16)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=16)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny, 21 C")
    assert second.choices[0].finish_reason == "tool_calls"


OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}


def test_tool_choice_required_and_named_are_forced_by_the_grammar(client):
    required = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=16)
    assert required.choices[0].message.tool_calls[0].function.name == CALL["name"]
    # The model always writes the weather call; forcing `other` makes the grammar spell another one.
    forced = client.chat.completions.create(model=NAME, messages=ASK, tools=[*TOOLS, OTHER], max_tokens=200,
                                            tool_choice={"type": "function", "function": {"name": "other"}})
    [call] = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "other" and json.loads(call.function.arguments) == {}
    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=[*TOOLS, OTHER], max_tokens=200,
                                            tool_choice={"type": "function", "function": {"name": "other"}},
                                            stream=True)
    streamed = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed if tc.function.name] == ["other"]
    assert json.loads("".join(tc.function.arguments for tc in streamed)) == json.loads(call.function.arguments)


@pytest.mark.parametrize("body, status, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "'nope'"),
    ({"tool_choice": "auto"}, 400, "without tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, 400, "defined twice"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "weather",
                                                                                           "arguments": "{bad"}}]}]},
     400, "not valid JSON"),
])
def test_bad_tool_input_is_a_400_naming_it(server, body, status, words):
    reply = request(server.url, "POST", "/v1/chat/completions",
                    {"model": NAME, "messages": ASK, "max_tokens": 4, **body})
    assert reply.status == status, reply.text
    assert words in reply.json()["error"]["message"]
    assert request(server.url, "GET", "/health").status == 200


def test_a_model_without_tool_support_refuses_tools_naming_it(tmp_path):
    pair = write_pair(tmp_path / "plain")
    with ServerProcess(*pair, log_path=tmp_path / "plain.log") as proc:
        reply = request(proc.url, "POST", "/v1/chat/completions",
                        {"model": "tiny-llama", "messages": ASK, "tools": TOOLS, "max_tokens": 4})
        assert reply.status == 400
        assert "'tiny-llama' does not support tool calling" in reply.json()["error"]["message"]


# -- Ollama -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ollama_client(server):
    ollama = pytest.importorskip("ollama")
    return ollama.Client(host=server.url, timeout=60)


def test_ollama_chat_returns_tool_calls(ollama_client):
    reply = ollama_client.chat(model=NAME, messages=ASK, tools=TOOLS, options={"num_predict": 16})
    assert reply.message.content == ""
    [call] = reply.message.tool_calls
    assert call.function.name == CALL["name"] and dict(call.function.arguments) == CALL["arguments"]
    streamed = [c for part in ollama_client.chat(model=NAME, messages=ASK, tools=TOOLS, stream=True,
                                                  options={"num_predict": 16})
                for c in (part.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [(CALL["name"], CALL["arguments"])]


def test_ollama_tool_results_are_accepted(ollama_client):
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
               {"role": "tool", "content": "sunny", "tool_name": "weather"}]
    first = ollama_client.chat(model=NAME, messages=ASK, tools=TOOLS, options={"num_predict": 16})
    second = ollama_client.chat(model=NAME, messages=history, tools=TOOLS, options={"num_predict": 16})
    assert second.prompt_eval_count > first.prompt_eval_count
    assert second.message.tool_calls


def test_ollama_bad_tools_are_a_400(server):
    reply = request(server.url, "POST", "/api/chat", {"model": NAME, "messages": ASK,
                                                       "tools": [{"type": "function", "function": {}}]})
    assert reply.status == 400 and "tools[0].function.name" in reply.json()["error"]


# -- Anthropic --------------------------------------------------------------------------------

A_TOOLS = [{"name": "weather", "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def claude(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def test_anthropic_tool_use_block(claude):
    msg = claude.messages.create(model=NAME, max_tokens=16, messages=ASK, tools=A_TOOLS)
    assert msg.stop_reason == "tool_use"
    [block] = msg.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == CALL["name"] and block.input == CALL["arguments"]
    with claude.messages.stream(model=NAME, max_tokens=16, messages=ASK, tools=A_TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content if b.type != "text"] \
        == [("tool_use", CALL["name"], CALL["arguments"])]
    assert all(b.text == "" for b in final.content if b.type == "text")


def test_anthropic_tool_result_round_trip(claude):
    first = claude.messages.create(model=NAME, max_tokens=16, messages=ASK, tools=A_TOOLS)
    use = first.content[0]
    history = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                        "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    n_first = claude.messages.count_tokens(model=NAME, messages=ASK, tools=A_TOOLS).input_tokens
    n_second = claude.messages.count_tokens(model=NAME, messages=history, tools=A_TOOLS).input_tokens
    def prompt(usage):
        return usage.input_tokens + usage.cache_read_input_tokens

    assert n_first == prompt(first.usage) and n_second > n_first + len("sunny")
    second = claude.messages.create(model=NAME, max_tokens=16, messages=history, tools=A_TOOLS)
    assert prompt(second.usage) == n_second and second.stop_reason == "tool_use"
    assert second.usage.cache_read_input_tokens >= n_first - 1  # the first turn's prompt was reused


def test_anthropic_tool_choice_forces_the_named_tool(claude):
    other = {"name": "other", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    msg = claude.messages.create(model=NAME, max_tokens=200, messages=ASK, tools=[*A_TOOLS, other],
                                 tool_choice={"type": "tool", "name": "other"})
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content if b.type == "tool_use"] == [("tool_use", "other", {})]


@pytest.mark.parametrize("body, words", [
    ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tools": A_TOOLS, "tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ({"tools": [{"description": "no name"}]}, "tools[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content"),
])
def test_anthropic_bad_tool_input_is_a_400(server, body, words):
    reply = request(server.url, "POST", "/v1/messages", {"model": NAME, "max_tokens": 4, "messages": ASK, **body})
    assert reply.status == 400, reply.text
    err = reply.json()
    assert err["type"] == "error" and words in err["error"]["message"]


def _stream_events(parser, start, end, text: str, step: int = 1, parallel: bool = True):
    from types import SimpleNamespace

    from dflash2_mlx.server.tools import CallCollector, CallEvent

    tok = SimpleNamespace(tool_call_start=start, tool_call_end=end, tool_parser=parser)
    collector = CallCollector.__new__(CallCollector)
    from dflash2_mlx.server.tools import ToolCallStream

    collector.stream, collector.bare, collector.parallel, collector.calls = (ToolCallStream(tok, TOOLS), None,
                                                                             parallel, [])
    collector.forced = False
    items = []
    for i in range(0, len(text), step):
        items += collector.events(text[i : i + step])
    items += collector.finish_events()
    return items, [i for i in items if isinstance(i, CallEvent)], collector


def test_json_call_arguments_stream_as_they_are_written():
    from mlx_lm.tool_parsers import json_tools

    args = {"path": "a.py", "content": "print(1)\n" * 20}
    body = json.dumps({"name": "write_file", "arguments": args})
    text = f"Writing it.<tool_call>{body}</tool_call>Done."
    items, events, collector = _stream_events(json_tools.parse_tool_call, "<tool_call>", "</tool_call>", text)
    assert [i for i in items if isinstance(i, str)] and "".join(i for i in items if isinstance(i, str)) == \
        "Writing it.Done."
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == 1 and kinds.count("args") > 50
    assert events[0].call.name == "write_file" and events[0].call is events[-1].call
    streamed = "".join(e.delta for e in events if e.kind == "args")
    assert json.loads(streamed) == args == events[-1].call.arguments == collector.calls[0].arguments
    start = next(i for i, e in enumerate(items) if not isinstance(e, str))
    assert items[:start] == list("Writing it.")  # text before the call comes first, in order


def test_calls_without_streamable_arguments_arrive_whole_and_bad_ones_stay_text():
    from mlx_lm.tool_parsers import json_tools, qwen3_coder

    xml = "<tool_call><function=weather><parameter=city>Paris</parameter></function></tool_call>"
    _, events, _ = _stream_events(qwen3_coder.parse_tool_call, "<tool_call>", "</tool_call>", xml, step=3)
    assert [e.kind for e in events] == ["start", "args", "end"]
    assert json.loads(events[1].delta) == {"city": "Paris"} == events[2].call.arguments
    items, events, _ = _stream_events(json_tools.parse_tool_call, "<tool_call>", "</tool_call>",
                                      "<tool_call>not json</tool_call>")
    assert events == [] and "".join(items) == "<tool_call>not json</tool_call>"
    two = "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': {}})}</tool_call>" for n in ("a", "b"))
    _, events, collector = _stream_events(json_tools.parse_tool_call, "<tool_call>", "</tool_call>", two,
                                          parallel=False)
    assert {e.call.name for e in events} == {"a"} and [c.name for c in collector.calls] == ["a"]


def test_a_forced_call_cut_by_max_tokens_leaks_no_markup(client):
    for n in (1, 2, 3, 5):
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[*TOOLS, OTHER], max_tokens=n,
                                               tool_choice="required")
        choice = reply.choices[0]
        assert not choice.message.content, (n, choice.message.content)  # never "\n\n<tool_call>..."
        for call in choice.message.tool_calls or ():  # a call that closed within the limit is kept whole
            assert json.loads(call.function.arguments) in (CALL["arguments"], {})
        if n == 1:
            assert choice.finish_reason == "length" and not choice.message.tool_calls


def test_a_call_cut_by_the_token_limit_is_not_a_call():
    from mlx_lm.tool_parsers import json_tools

    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": "tr'
    _, events, collector = _stream_events(json_tools.parse_tool_call, "<tool_call>", "</tool_call>", text)
    assert [(e.kind, e.call.name) for e in events if e.kind in ("end", "cut")] == [("end", "a"), ("cut", "b")]
    assert [c.name for c in collector.calls] == ["a"]
