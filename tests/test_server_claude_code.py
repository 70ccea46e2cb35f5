"""What Claude Code sends to /v1/messages, taken as it needs: `thinking`, `max_tokens` far above the
cap (clamped, with a header), system messages between turns, the billing-header block (dropped, so
the prompt prefix is stable across requests), deferred tools, beta headers and ignored fields; an
over-long prompt refused in the words Claude Code compacts on; no empty text block before a tool."""

from __future__ import annotations

import json

import pytest
from test_server_harness import ServerProcess, open_stream, request, sse_events

from tool_model import CALL, save_tool_pair

anthropic = pytest.importorskip("anthropic")

NAME = "tool-target"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {"name": "weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
BETA = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}


def claude_body(**extra) -> dict:
    """A request shaped like Claude Code's (2.1.x): billing header, cache_control, thinking, huge max_tokens."""
    body = {"model": NAME, "max_tokens": 128000, "stream": False,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=1a2b3c;"},
                       {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [*ASK, {"role": "system", "content": [{"type": "text", "text": "# Environment: /tmp"}]}],
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u"}, "tools": [TOOL, {**TOOL, "name": "Later", "defer_loading": True}]}
    return body | extra


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("toolpair"))
    log = tmp_path_factory.mktemp("logs") / "claude.log"
    with ServerProcess(*pair, "--block-size", "4", "--max-tokens-cap", "64", log_path=log) as proc:
        yield proc


def test_a_claude_code_request_is_served(server):
    reply = request(server.url, "POST", "/v1/messages", claude_body(), headers=BETA)
    assert reply.status == 200, reply.json()
    msg = reply.json()
    assert msg["stop_reason"] == "tool_use" and msg["content"][-1]["name"] == CALL["name"]
    assert reply.headers["x-dflash2-max-tokens"] == "64; asked=128000"


def test_the_billing_header_and_mid_conversation_system_messages_are_merged(server):
    ours = request(server.url, "POST", "/v1/messages/count_tokens", claude_body(), headers=BETA).json()
    other_cch = claude_body(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=9f;"},
                                    {"type": "text", "text": "You are a coding agent."}])
    assert request(server.url, "POST", "/v1/messages/count_tokens", other_cch).json() == ours
    plain = {"model": NAME, "system": "You are a coding agent.\n\n# Environment: /tmp", "messages": ASK,
             "tools": [TOOL]}
    assert request(server.url, "POST", "/v1/messages/count_tokens", plain).json() == ours


def test_prefix_cache_reuses_the_whole_previous_turn(server):
    first = request(server.url, "POST", "/v1/messages", claude_body()).json()
    turn = [*ASK, {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first["content"][-1]["id"],
                                          "content": "sunny"}]},
            {"role": "system", "content": "# Environment: /tmp"}]
    second = request(server.url, "POST", "/v1/messages", claude_body(
        messages=turn, system=[{"type": "text", "text": "x-anthropic-billing-header: cch=ffff;"},
                               {"type": "text", "text": "You are a coding agent."}])).json()
    usage = second["usage"]
    # the whole first prompt is reused (the billing header's new cch= changed nothing)
    assert (usage["cache_read_input_tokens"]
            >= first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"] - 1)


def test_a_prompt_over_the_window_uses_anthropics_words(server, tmp_path):
    long = [{"role": "user", "content": "Weather? " * 3000}]
    reply = request(server.url, "POST", "/v1/messages", claude_body(messages=long))
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("prompt is too long: ")
    assert "tokens >" in error["message"] and "maximum" in error["message"]


def test_no_empty_text_block_before_a_streamed_tool_use(server):
    _, resp = open_stream(server.url, "/v1/messages", claude_body(stream=True))
    events = [e for e in sse_events(resp)]
    starts = [e["content_block"]["type"] for e in events if e.get("type") == "content_block_start"]
    assert starts == ["tool_use"]
    delta = next(e for e in events if e.get("type") == "message_delta")
    assert {"input_tokens", "output_tokens", "cache_read_input_tokens"} <= set(delta["usage"])


def test_thinking_types(server):
    for kind in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        assert request(server.url, "POST", "/v1/messages", claude_body(thinking=kind)).status == 200
    bad = request(server.url, "POST", "/v1/messages", claude_body(thinking={"type": "sometimes"}))
    assert bad.status == 400 and "thinking.type" in bad.json()["error"]["message"]


def test_the_sdk_with_claude_codes_fields(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60,
                                 default_headers=BETA)
    fields = {k: v for k, v in claude_body().items() if k not in ("stream", "context_management", "output_config")}
    extra = {k: claude_body()[k] for k in ("context_management", "output_config")}  # beta fields, sent raw
    with client.messages.stream(**fields, extra_body=extra) as stream:
        final = stream.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].input == CALL["arguments"]
    assert json.loads(json.dumps(final.usage.model_dump()))["output_tokens"] > 0


def test_the_request_log_has_a_line_per_request(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("toolpair2"))
    log_file = tmp_path_factory.mktemp("rl") / "requests.jsonl"
    with ServerProcess(*pair, "--request-log", str(log_file), log_path=log_file.with_suffix(".log")) as proc:
        request(proc.url, "POST", "/v1/messages", claude_body(max_tokens=8))
        request(proc.url, "POST", "/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 4})
    lines = [json.loads(x) for x in log_file.read_text().splitlines()]
    assert [x["endpoint"] for x in lines] == ["messages", "responses"]
    assert all(x["outcome"] == "completed" and x["prompt_n"] > 0 and "cache_n" in x and x["prompt_ms"] > 0
               for x in lines)
