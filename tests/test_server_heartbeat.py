"""Stream keep-alives (`serve --heartbeat`): while a request waits for its first token (a long
prefill, a queue), Responses streams repeat `response.in_progress` and Messages streams send
`ping`, because Codex drops a stream after 300 s without an event and SSE comments do not count.
The keep-alives never break the documented event order, and the SDKs read such streams."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from test_server_harness import ServerProcess, open_stream, sse_events

from dflash2_mlx.server.worker import IDLE, Finished, Job, JobStats

from tool_model import CALL_TEXT, save_tool_pair

NAME = "tool-target"
LONG_ASK = "Weather in Paris? " * 200  # a prefill long enough to outlast a 1 ms heartbeat
DOCUMENTED_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = save_tool_pair(tmp_path_factory.mktemp("toolpair"))
    log = tmp_path_factory.mktemp("logs") / "heartbeat.log"
    with ServerProcess(*pair, "--block-size", "4", "--heartbeat", "0.001", log_path=log) as proc:
        yield proc


def _responses_stream(server) -> list[dict]:
    body = {"model": NAME, "input": LONG_ASK, "max_output_tokens": 16, "stream": True}
    conn, resp = open_stream(server.url, "/v1/responses", body)
    events = sse_events(resp)
    conn.close()
    return events


def _messages_stream(server) -> list[tuple[str, dict]]:
    body = {"model": NAME, "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": LONG_ASK}]}
    conn, resp = open_stream(server.url, "/v1/messages", body)
    lines = resp.read().decode().splitlines()
    conn.close()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
    data = [json.loads(line.split(":", 1)[1]) for line in lines if line.startswith("data:")]
    return list(zip(names, data))


def test_responses_keep_alives_keep_the_documented_order(server):
    events = _responses_stream(server)
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    beats = [e for e in events[2:] if e["type"] == "response.in_progress"]
    assert all(e["response"]["status"] == "in_progress" for e in beats)
    rest = kinds[:2] + [k for k in kinds[2:] if k != "response.in_progress"]
    assert rest[:4] == DOCUMENTED_TEXT and rest[-1] == "response.completed", kinds
    assert events[-1]["response"]["status"] == "completed" and events[-1]["response"]["output"]


def test_a_long_prefill_sends_keep_alives_on_both_apis(server):
    responses_beats = sum(e["type"] == "response.in_progress" for e in _responses_stream(server)[2:])
    messages = _messages_stream(server)
    pings = sum(name == "ping" for name, _ in messages)
    assert responses_beats + pings >= 1, (responses_beats, pings)
    assert all(data == {"type": "ping"} for name, data in messages if name == "ping")
    names = [name for name, _ in messages if name != "ping"]
    assert names[:2] == ["message_start", "content_block_start"] and names[-1] == "message_stop", names


def test_the_sdks_read_streams_with_keep_alives(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    whole = oa.responses.create(model=NAME, input=LONG_ASK, max_output_tokens=16)
    with oa.responses.stream(model=NAME, input=LONG_ASK, max_output_tokens=16) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == f"<tool_call>{CALL_TEXT}</tool_call>"
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with an.messages.stream(model=NAME, max_tokens=16, messages=[{"role": "user", "content": LONG_ASK}]) as s:
        streamed = "".join(s.text_stream)
    assert streamed == whole.output_text


def test_job_events_yield_idle_in_silence_and_lose_no_item():
    async def scenario():
        job = Job(prompt_ids=[1], sampling=None, max_tokens=1, stop=[], loop=asyncio.get_running_loop())
        seen = []

        async def producer():
            await asyncio.sleep(0.2)
            job.post("first")
            await asyncio.sleep(0.2)
            job.post("second")
            job.post(Finished(JobStats()))

        task = asyncio.create_task(producer())
        async for item in job.events(idle=0.02):
            seen.append(item)
        await task
        return seen

    seen = asyncio.run(scenario())
    assert [s for s in seen if s is not IDLE] == ["first", "second"]
    assert seen.index("first") >= 1 and seen.count(IDLE) >= 2, seen
