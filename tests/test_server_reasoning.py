"""A thinking model's reasoning goes to each API's own channel and never into the content:
OpenAI chat `reasoning_content`, Anthropic `thinking` blocks, Ollama `thinking`, Responses
`reasoning` items; streamed or not; and thinking turned off leaves none."""

from __future__ import annotations

import json

import pytest
from test_server_harness import ServerProcess, ndjson_lines, open_stream, request, sse_events

from dflash2_mlx.server.reasoning import ReasoningSplit, split_all

from tool_model import ANSWER, THOUGHT, save_tool_pair

NAME = "tool-target"
ASK = [{"role": "user", "content": "Think?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("thinkpair"), thinking=True)
    log = tmp_path_factory.mktemp("logs") / "think.log"
    with ServerProcess(*pair, "--block-size", "4", log_path=log) as proc:
        yield proc


def test_split_holds_back_partial_markers_and_starts_inside_when_the_prompt_opened_it():
    split = ReasoningSplit("<think>", "</think>", inside=False)
    pieces = [p for ch in "a<think>b</th" for p in split.feed(ch)] + split.feed("ink>c") + split.finish()
    assert pieces == [("content", "a"), ("reasoning", "b"), ("content", "c")]
    assert split_all(ReasoningSplit("<think>", "</think>", inside=True), "why</think>so") == ("why", "so")
    assert split_all(None, "x<think>y") == ("", "x<think>y")


def test_openai_chat_reasoning_content(server):
    reply = request(server.url, "POST", "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 16})
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT and message["content"] == ANSWER
    _, resp = open_stream(server.url, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 16,
                                                                "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(resp) if isinstance(e, dict) and e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    off = request(server.url, "POST", "/v1/chat/completions", {
        "model": NAME, "messages": ASK, "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["choices"][0]["message"]["content"] == ANSWER and "reasoning_content" not in off["choices"][0]["message"]


def test_anthropic_thinking_blocks(server):
    body = {"model": NAME, "messages": ASK, "max_tokens": 16, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    msg = request(server.url, "POST", "/v1/messages", body).json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][0]["thinking"] == THOUGHT and msg["content"][1]["text"] == ANSWER
    _, resp = open_stream(server.url, "/v1/messages", body | {"stream": True})
    events = [e for e in sse_events(resp) if isinstance(e, dict)]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thought = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert thought == THOUGHT and text == ANSWER
    omitted = request(server.url, "POST", "/v1/messages", body | {"thinking": {"type": "adaptive",
                                                                               "display": "omitted"}}).json()
    assert [b["type"] for b in omitted["content"]] == ["text"] and omitted["content"][0]["text"] == ANSWER
    plain = request(server.url, "POST", "/v1/messages", {k: v for k, v in body.items() if k != "thinking"}).json()
    assert [b["type"] for b in plain["content"]] == ["text"] and plain["content"][0]["text"] == ANSWER
    # an earlier turn's thinking block is accepted back (and left out of the prompt)
    history = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                       {"type": "text", "text": "ok"}]},
               {"role": "user", "content": "Again?"}]
    assert request(server.url, "POST", "/v1/messages", body | {"messages": history}).status == 200


def test_ollama_thinking_field(server):
    reply = request(server.url, "POST", "/api/chat", {"model": NAME, "messages": ASK, "stream": False}).json()
    assert reply["message"]["thinking"] == THOUGHT and reply["message"]["content"] == ANSWER
    _, resp = open_stream(server.url, "/api/chat", {"model": NAME, "messages": ASK})
    lines = ndjson_lines(resp)
    assert "".join(x["message"].get("thinking", "") for x in lines) == THOUGHT
    assert "".join(x["message"]["content"] for x in lines) == ANSWER


def test_responses_reasoning_item(server):
    body = {"model": NAME, "input": "Think?", "max_output_tokens": 16}
    reply = request(server.url, "POST", "/v1/responses", body).json()
    assert [o["type"] for o in reply["output"]] == ["reasoning", "message"]
    assert reply["output"][0]["content"][0]["text"] == THOUGHT
    assert reply["output"][1]["content"][0]["text"] == ANSWER
    _, resp = open_stream(server.url, "/v1/responses", body | {"stream": True})
    events = sse_events(resp)
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message"]
    json.dumps(events)


def test_anthropic_budget_tokens_closes_the_thinking_span(server):
    body = {"model": NAME, "messages": ASK, "max_tokens": 16, "thinking": {"type": "enabled", "budget_tokens": 1}}
    msg = request(server.url, "POST", "/v1/messages", body).json()
    # the model would think "hm"; one token in, its end marker is forced and the answer follows
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in msg["content"]] == [
        ("thinking", THOUGHT[:1]), ("text", ANSWER)]
    _, resp = open_stream(server.url, "/v1/messages", body | {"stream": True})
    events = [e for e in sse_events(resp) if isinstance(e, dict)]
    assert "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta") == "h"
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == ANSWER
    roomy = request(server.url, "POST", "/v1/messages", body | {"thinking": {"type": "enabled",
                                                                             "budget_tokens": 2}}).json()
    assert roomy["content"][0]["thinking"] == THOUGHT  # a budget the span fits in changes nothing
    for bad in (0, 2.5, "9"):
        reply = request(server.url, "POST", "/v1/messages", body | {"thinking": {"type": "enabled",
                                                                                 "budget_tokens": bad}})
        assert reply.status == 400 and "budget_tokens" in reply.json()["error"]["message"], bad
