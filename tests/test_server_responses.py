"""The OpenAI Responses API (POST /v1/responses) through a real `dflash2 serve` process and the
official SDK: text and tool calls, streamed in the documented event order, instructions and
developer items merged into one system message, tool history, namespaces, the response store,
structured output, and refusals that name the field."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_harness import ServerProcess, open_stream, request, sse_events

from dflash2_mlx.server import responses
from dflash2_mlx.server.errors import APIError
from dflash2_mlx.server.schema import ResponsesRequest

from tool_model import CALL, CALL_TEXT, save_tool_pair

NAME = "tool-target"
TOOL = {"type": "function", "name": "weather", "description": "Weather in a city", "strict": False,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("toolpair"))
    log = tmp_path_factory.mktemp("logs") / "responses.log"
    with ServerProcess(*pair, "--block-size", "4", log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_text_reply_equals_the_chat_route(client):
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ASK}], max_tokens=16)
    reply = client.responses.create(model=NAME, input=ASK, max_output_tokens=16)
    assert reply.status == "completed" and reply.object == "response"
    assert reply.output_text == chat.choices[0].message.content == f"<tool_call>{CALL_TEXT}</tool_call>"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.input_tokens_details.cached_tokens >= 0
    assert reply.usage.output_tokens == chat.usage.completion_tokens


def test_a_tool_call_is_a_function_call_item(client):
    reply = client.responses.create(model=NAME, input=ASK, tools=[TOOL], max_output_tokens=16)
    [item] = reply.output
    assert item.type == "function_call" and item.status == "completed" and item.call_id.startswith("call_")
    assert item.name == CALL["name"] and json.loads(item.arguments) == CALL["arguments"]


def test_a_streamed_call_follows_the_documented_event_order(server):
    body = {"model": NAME, "input": ASK, "tools": [TOOL], "max_output_tokens": 16, "stream": True}
    _, resp = open_stream(server.url, "/v1/responses", body)
    events = sse_events(resp)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["status"] == "completed"
    assert json.loads(events[4]["arguments"]) == CALL["arguments"] == json.loads(events[3]["delta"])
    assert events[-1]["response"]["output"][0]["name"] == CALL["name"]


def test_streamed_text_equals_the_non_streamed_reply(client, server):
    whole = client.responses.create(model=NAME, input=ASK, max_output_tokens=16)
    body = {"model": NAME, "input": ASK, "max_output_tokens": 16, "stream": True}
    _, resp = open_stream(server.url, "/v1/responses", body)
    events = sse_events(resp)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-4]["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text


def test_the_sdk_streams_too(client):
    with client.responses.stream(model=NAME, input=ASK, tools=[TOOL], max_output_tokens=16) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == CALL["name"]


def test_instructions_and_developer_items_become_one_leading_system_message(client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": ASK},
             {"type": "message", "role": "system", "content": "Answer in English."}]
    reply = client.responses.create(model=NAME, input=items, instructions="You are a weather bot.",
                                    max_output_tokens=1)
    chat = client.chat.completions.create(model=NAME, max_tokens=1, messages=[
        {"role": "system", "content": "You are a weather bot.\n\nBe brief.\n\nAnswer in English."},
        {"role": "user", "content": ASK}])
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_tool_history_is_rendered(client):
    first = client.responses.create(model=NAME, input=ASK, tools=[TOOL], max_output_tokens=16)
    call = first.output[0]
    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
               {"type": "reasoning", "id": "rs_1", "summary": []}]
    second = client.responses.create(model=NAME, input=history, tools=[TOOL], max_output_tokens=16)
    chat = client.chat.completions.create(model=NAME, max_tokens=16, tools=[
        {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_previous_response_id_continues_a_stored_conversation(client, server):
    first = client.responses.create(model=NAME, input=ASK, max_output_tokens=16)
    second = client.responses.create(model=NAME, input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=4)
    chat = client.chat.completions.create(model=NAME, max_tokens=4, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    got = request(server.url, "GET", f"/v1/responses/{first.id}").json()
    assert got["id"] == first.id and got["output"][0]["content"][0]["text"] == first.output_text
    unstored = client.responses.create(model=NAME, input=ASK, max_output_tokens=2, store=False)
    for rid in ("resp_missing", unstored.id):
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as e:
            client.responses.create(model=NAME, input="x", previous_response_id=rid, max_output_tokens=2)
        assert rid in str(e.value)
    assert request(server.url, "GET", "/v1/responses/resp_missing").status == 404


def test_json_schema_format_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.responses.create(model=NAME, input=ASK, max_output_tokens=160,
                                    text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(reply.output_text)) == {"city"}


def test_length_cut_is_incomplete(client):
    reply = client.responses.create(model=NAME, input=ASK, max_output_tokens=1)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"type": "web_search", "external_web_access": False}]}, ["web_search", 'web_search = "disabled"']),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     ["input[0].content[0]", "input_image"]),
    ({"input": [{"type": "item_reference", "id": "x"}]}, ["input[0]", "item_reference"]),
    ({"text": {"format": {"type": "yaml"}}}, ["text.format.type", "yaml"]),
    ({"tool_choice": "required"}, ["tool_choice", "without tools"]),
])
def test_refusals_name_the_field(server, body, words):
    resp = request(server.url, "POST", "/v1/responses", {"model": NAME, "input": ASK, **body})
    assert resp.status == 400, resp.json()
    message = resp.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_namespaced_tools_are_flattened_and_calls_mapped_back():
    body = ResponsesRequest(input="x", tools=[TOOL, {"type": "namespace", "name": "mcp__files__", "description": "d",
                                                     "tools": [{"type": "function", "name": "read",
                                                                "parameters": {}}]}])
    flat, spaces = responses.flat_tools(body)
    assert [t["function"]["name"] for t in flat] == ["weather", "mcp__files__read"]
    assert spaces == {"mcp__files__read": ("mcp__files__", "read")}
    from dflash2_mlx.server.tools import ToolCall

    item = responses._call_item(ToolCall("mcp__files__read", {"path": "a"}), spaces)
    assert item["name"] == "read" and item["namespace"] == "mcp__files__" and item["id"].startswith("fc_")
    history = ResponsesRequest(input=[{"type": "function_call", "call_id": "c1", "name": "read",
                                       "namespace": "mcp__files__", "arguments": '{"path": "a"}'}])
    _, messages = responses.input_messages(history)
    assert messages[0]["tool_calls"][0]["function"] == {"name": "mcp__files__read", "arguments": {"path": "a"}}
    with pytest.raises(APIError, match=r"tools\[0\].tools\[0\]"):
        responses.flat_tools(ResponsesRequest(input="x", tools=[{"type": "namespace", "name": "n",
                                                                 "tools": [{"type": "web_search"}]}]))
