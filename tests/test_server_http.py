"""`dflash2 serve` as a real process: OpenAI SDK, Ollama NDJSON, load, disconnects, bad input.

Two servers on the tiny pair: `server` (API key, small caps, for the API, load and fuzz
tests) and `small` (--max-concurrency 2, --max-batch 1, for queueing, cancellation and shutdown).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading

import openai
import pytest
from test_server_harness import (
    ServerProcess,
    connect,
    metrics,
    ndjson_lines,
    open_stream,
    request,
    sse_events,
    start_cli,
    wait_for,
    write_pair,
)

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Hello world"
N = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with ServerProcess(*pair, "--api-key", API_KEY, "--max-tokens-cap", "32", "--max-prompt-tokens", "256",
                       log_path=log) as proc:
        yield proc
        proc.signal(signal.SIGINT)  # Ctrl-C: a graceful stop and exit code 0
        assert proc.wait(60) == 0, proc.logs()[-4000:]
        assert "Traceback" not in proc.logs(), proc.logs()


@pytest.fixture(scope="module")
def refs(pair):
    """`dflash2 run --json` for PROMPT, with the chat template and raw (two processes at once)."""
    target, drafter = pair
    common = ["run", str(target), PROMPT, "--drafter", str(drafter), "--max-tokens", str(N), "--json"]
    runs = {"chat": start_cli(*common), "raw": start_cli(*common, "--no-chat-template")}
    out = {}
    for key, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        out[key] = json.loads(stdout)
    return out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _check_timings(timings: dict, ref: dict) -> None:
    assert timings["prompt_n"] == ref["prompt_tokens"]
    assert timings["predicted_n"] == ref["n_tokens"]
    assert timings["tokens_per_cycle"] == pytest.approx(ref["tau"], abs=1e-3)
    assert timings["draft_n"] >= ref["speculative_cycles"] > 0
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0


# -- OpenAI --------------------------------------------------------------------------------


def test_chat_equals_run_json(client, server, refs):
    ref = refs["chat"]
    reply = client.chat.completions.create(model=server.banner["model"], max_tokens=N, temperature=0,
                                           messages=[{"role": "user", "content": PROMPT}])
    assert reply.choices[0].message.content == ref["text"]
    assert reply.choices[0].finish_reason == ref["finish_reason"]
    assert reply.usage.completion_tokens == ref["n_tokens"] and reply.usage.prompt_tokens == ref["prompt_tokens"]
    _check_timings(reply.model_extra["timings"], ref)


def test_chat_stream_equals_run_json(client, refs):
    ref = refs["chat"]
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
                                                 model="tiny-llama", stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [ref["finish_reason"]]
    _check_timings(finals[0].model_extra["timings"], ref)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["n_tokens"]


def test_completions_equal_run_raw(client, refs):
    ref = refs["raw"]
    reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=N)
    assert reply.choices[0].text == ref["text"] and reply.usage.completion_tokens == ref["n_tokens"]
    _check_timings(reply.model_extra["timings"], ref)
    stream = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=N, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref["text"]


def test_stop_strings_and_token_prompt(client, refs):
    ref = refs["raw"]
    stop = ref["text"][6:8]
    cut = ref["text"].find(stop)
    assert cut > 0
    reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=N, stop=[stop])
    assert reply.choices[0].text == ref["text"][:cut] and reply.choices[0].finish_reason == "stop"
    ids = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1).model_extra["timings"]
    assert ids["prompt_n"] == ref["prompt_tokens"]


def test_seeded_sampling_repeats(client):
    kwargs = dict(model="tiny-llama", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
                  extra_body={"top_k": 40})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_api_key_on_the_command_line_is_warned_about(server):
    assert "--api-key on the command line is visible" in server.logs()


def test_models_health_and_auth(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    health = request(server.url, "GET", "/health")
    assert health.status == 200 and health.json()["status"] == "ok"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- Ollama --------------------------------------------------------------------------------


def _check_ollama_done(last: dict, ref: dict) -> None:
    assert last["done"] is True and last["done_reason"] == ref["finish_reason"]
    assert last["prompt_eval_count"] == ref["prompt_tokens"] and last["eval_count"] == ref["n_tokens"]
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0
    assert last["total_duration"] >= last["eval_duration"] > 0
    _check_timings(last["timings"], ref)


def test_ollama_generate_ndjson(server, refs):
    ref = refs["raw"]
    body = {"model": "tiny-llama", "prompt": PROMPT, "raw": True, "options": {"num_predict": N, "temperature": 0}}
    conn, resp = open_stream(server.url, "/api/generate", body, AUTH)
    assert resp.status == 200 and resp.getheader("content-type").startswith("application/x-ndjson")
    lines = ndjson_lines(resp)
    conn.close()
    assert all(line["done"] is False and line["model"] == "tiny-llama" for line in lines[:-1])
    assert all(line["created_at"].endswith("Z") for line in lines)
    assert "".join(line["response"] for line in lines) == ref["text"]
    _check_ollama_done(lines[-1], ref)
    assert lines[-1]["context"][-ref["n_tokens"]:] == ref["token_ids"]
    single = request(server.url, "POST", "/api/generate", {**body, "stream": False}, AUTH).json()
    assert single["response"] == ref["text"] and single["context"] == lines[-1]["context"]


def test_ollama_chat_ndjson(server, refs):
    ref = refs["chat"]
    body = {"model": "tiny-llama:latest", "messages": [{"role": "user", "content": PROMPT}],
            "options": {"num_predict": N}}
    conn, resp = open_stream(server.url, "/api/chat", body, AUTH)
    lines = ndjson_lines(resp)
    conn.close()
    assert all(line["message"]["role"] == "assistant" for line in lines)
    assert "".join(line["message"]["content"] for line in lines) == ref["text"]
    assert lines[0]["model"] == "tiny-llama:latest"
    _check_ollama_done(lines[-1], ref)


def test_ollama_tags_and_version(server):
    tags = request(server.url, "GET", "/api/tags", headers=AUTH).json()
    (model,) = tags["models"]
    assert model["name"] == "tiny-llama:latest" and model["size"] > 0
    assert model["details"]["family"] == "llama" and model["details"]["parameter_size"].endswith("K")
    assert request(server.url, "GET", "/api/version", headers=AUTH).json()["version"]
    shown = request(server.url, "POST", "/api/show", {"model": "tiny-llama"}, AUTH).json()
    assert shown["details"] == model["details"] and shown["model_info"]["llama.context_length"] == 4096
    assert "assistant:" in shown["template"]
    assert request(server.url, "POST", "/api/show", {"model": "other"}, AUTH).status == 404
    assert request(server.url, "HEAD", "/", headers=AUTH).status == 200


# -- load ----------------------------------------------------------------------------------


def test_32_concurrent_streams_x3(server, client):
    prompts = [f"Client {i} says hi" for i in range(32)]
    expected = [client.completions.create(model="tiny-llama", prompt=p, max_tokens=8).choices[0].text
                for p in prompts]
    assert len(set(expected)) > 1  # different prompts: a mix-up between clients would show

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def rounds():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        results = []
        for _ in range(3):
            results.append(await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), 180))
        await aclient.close()
        return results

    for got in asyncio.run(rounds()):
        assert got == expected
    health = request(server.url, "GET", "/health").json()
    assert health.pop("speculation")["active"] is True
    assert health == {"status": "ok", "model": "tiny-llama", "busy": False, "queue_depth": 0}
    m = metrics(server.url, AUTH)
    assert m['dflash2_requests_total{route="/v1/completions",status="200"}'] >= 32 * 4
    assert m["dflash2_queue_depth"] == 0 and m['dflash2_jobs_total{outcome="failed"}'] == 0


# -- bad input -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("malformed json", CHAT, None, b'{"messages": [', 400),
    ("json array body", CHAT, None, b"[1, 2]", 400),
    ("messages not a list", CHAT, {"messages": "hi"}, None, 400),
    ("empty messages", CHAT, {"messages": []}, None, 400),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, None, 400),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400),
    ("negative max_tokens", CHAT, {"messages": MSG, "max_tokens": -1}, None, 400),
    ("zero max_tokens", CHAT, {"messages": MSG, "max_tokens": 0}, None, 400),
    ("huge max_tokens", CHAT, {"messages": MSG, "max_tokens": 10**12}, None, 400),
    ("max_tokens over cap", CHAT, {"messages": MSG, "max_completion_tokens": 33}, None, 400),
    ("max_tokens a string", CHAT, {"messages": MSG, "max_tokens": "ten"}, None, 400),
    ("temperature negative", CHAT, {"messages": MSG, "temperature": -1}, None, 400),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, None, 400),
    ("n=2", CHAT, {"messages": MSG, "n": 2}, None, 400),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400),
    ("stream not a bool", CHAT, {"messages": MSG, "stream": [1]}, None, 400),
    ("too many stops", CHAT, {"messages": MSG, "stop": ["x"] * 100}, None, 400),
    ("unknown model", CHAT, {"messages": MSG, "model": "gpt-4o"}, None, 404),
    ("absolute path model", CHAT, {"messages": MSG, "model": "/etc/passwd"}, None, 400),
    ("relative path model", CHAT, {"messages": MSG, "model": "../tiny-llama"}, None, 400),
    ("gguf model", "/v1/completions", {"prompt": "x", "model": "x.gguf"}, None, 400),
    ("oversized prompt", "/v1/completions", {"prompt": "ab" * 400}, None, 400),
    ("token ids outside vocab", "/v1/completions", {"prompt": [5, 5000]}, None, 400),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, None, 400),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, None, 400),
    ("ollama prompt type", "/api/generate", {"prompt": 5}, None, 400),
    ("ollama num_predict 0", "/api/generate", {"prompt": "a", "options": {"num_predict": 0}}, None, 400),
    ("ollama path model", "/api/chat", {"model": "/tmp/x", "messages": MSG}, None, 400),
    ("ollama images", "/api/chat", {"messages": [{"role": "user", "content": "a", "images": ["AA=="]}]}, None, 400),
]


@pytest.mark.parametrize("name,path,body,raw,status", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_4xx_json(server, name, path, body, raw, status):
    headers = {**AUTH, "Content-Type": "application/json"}
    reply = request(server.url, "POST", path, body=body, raw=raw, headers=headers)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    message = error if path.startswith("/api/") else error["message"]
    assert isinstance(message, str) and message


AUTH_AND_ROUTES = [
    ("no key", "GET", "/v1/models", {}, 401),
    ("wrong key", "GET", "/metrics", {"Authorization": "Bearer nope"}, 401),
    ("basic auth", "GET", "/api/tags", {"Authorization": f"Basic {API_KEY}"}, 401),
    ("schema needs key", "GET", "/openapi.json", {}, 401),
    ("text/plain body", "POST", CHAT, {**AUTH, "Content-Type": "text/plain"}, 400),
    ("wrong method", "GET", CHAT, AUTH, 405),
    ("unknown route", "GET", "/v1/nope", AUTH, 404),
    ("body too large", "POST", CHAT, {**AUTH, "Content-Length": "99999999"}, 413),
]


@pytest.mark.parametrize("name,method,path,headers,status", AUTH_AND_ROUTES, ids=[c[0] for c in AUTH_AND_ROUTES])
def test_bad_auth_and_routes(server, name, method, path, headers, status):
    conn = connect(server.url)
    conn.putrequest(method, path)
    for key, value in headers.items():
        conn.putheader(key, value)
    body = b'{"messages": []}' if method == "POST" and "Content-Length" not in headers else None
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    reply = resp.read()
    conn.close()
    assert resp.status == status, reply
    assert "error" in json.loads(reply)
    if status == 401:
        assert resp.getheader("www-authenticate") == "Bearer"


def test_alive_after_bad_input(server):
    assert request(server.url, "GET", "/health").status == 200
    reply = request(server.url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, AUTH)
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 4


def _schemathesis(url: str, cwd, *options: str) -> subprocess.CompletedProcess:
    pytest.importorskip("schemathesis")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "-H",
           f"Authorization: Bearer {API_KEY}", "--checks", "not_a_server_error", "--seed", "1",
           "--generation-database", "none", "--no-shrink", "--request-timeout", "30", "--workers", "1",
           "--no-color", *options]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_schemathesis_fuzz_finds_no_5xx(server, tmp_path):
    done = _schemathesis(server.url, tmp_path, "--phases", "fuzzing", "--max-examples", "5")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert request(server.url, "GET", "/health").status == 200


@pytest.mark.slow
def test_schemathesis_coverage_finds_no_5xx(server, tmp_path):
    done = _schemathesis(server.url, tmp_path, "--phases", "examples,coverage,fuzzing", "--max-examples", "20")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert request(server.url, "GET", "/health").status == 200


# -- queueing, cancellation, shutdown --------------------------------------------------------


@pytest.fixture(scope="module")
def small(pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "small.log"
    # --max-batch 1: one request at a time, so the second one queues (batching: test_server_batch.py)
    with ServerProcess(*pair, "--max-concurrency", "2", "--max-tokens-cap", "2000", "--shutdown-timeout", "20",
                       "--max-batch", "1", log_path=log) as proc:
        yield proc


def _stream_first_chunk(url: str, max_tokens: int):
    conn, resp = open_stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True})
    assert resp.status == 200
    return conn, resp


def test_full_queue_429_and_disconnects_free_the_worker(small):
    url = small.url
    before = metrics(url)
    running, resp = _stream_first_chunk(url, 1500)
    assert resp.readline().startswith(b"data:")  # generating
    waiting, _ = _stream_first_chunk(url, 1500)  # admitted, queued behind the first
    assert wait_for(lambda: request(url, "GET", "/health").json()["queue_depth"] == 1)
    full = request(url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert full.status == 429 and int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["code"] == "server_busy"

    waiting.close()  # leaves the queue without running
    assert wait_for(lambda: request(url, "GET", "/health").json()["queue_depth"] == 0)
    running.close()  # cancels mid-generation
    assert wait_for(lambda: metrics(url)['dflash2_jobs_total{outcome="cancelled"}']
                    - before['dflash2_jobs_total{outcome="cancelled"}'] == 2)
    after = metrics(url)
    assert after["dflash2_requests_running"] == 0
    assert after["dflash2_cycles_after_cancel_max"] <= 1
    assert after["dflash2_generated_tokens_total"] - before["dflash2_generated_tokens_total"] < 1500
    ok = request(url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 3


LONG = [
    ("chat sse", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1500,
                                          "stream": True}),
    ("ollama ndjson", "/api/generate", {"prompt": PROMPT, "options": {"num_predict": 1500}}),
    ("not streaming", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1500}),
]


@pytest.mark.parametrize("name,path,body", LONG, ids=[c[0] for c in LONG])
def test_disconnect_mid_generation_cancels_it(small, name, path, body):
    url = small.url
    before = metrics(url)
    conn = connect(url)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    assert wait_for(lambda: metrics(url)["dflash2_requests_running"] == 1)
    conn.close()
    key = 'dflash2_jobs_total{outcome="cancelled"}'
    assert wait_for(lambda: metrics(url)[key] - before[key] == 1)
    after = metrics(url)
    assert after["dflash2_requests_running"] == 0 and after["dflash2_cycles_after_cancel_max"] <= 1
    assert after["dflash2_generated_tokens_total"] - before["dflash2_generated_tokens_total"] < 1500


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(small):
    url = small.url
    results = {}

    def streamed():
        conn, resp = _stream_first_chunk(url, 120)
        results["stream"] = sse_events(resp)
        conn.close()

    def plain():
        results["plain"] = request(url, "POST", "/v1/completions", {"prompt": "Bye", "max_tokens": 40}, timeout=120)

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    threads[0].start()
    assert wait_for(lambda: request(url, "GET", "/health").json()["busy"])
    threads[1].start()
    assert wait_for(lambda: request(url, "GET", "/health").json()["queue_depth"] == 1)
    small.signal()
    for t in threads:
        t.join(120)
    assert small.wait(60) == 0, small.logs()[-4000:]
    events = results["stream"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["timings"]["predicted_n"] == 120
    assert results["plain"].status == 200 and results["plain"].json()["usage"]["completion_tokens"] == 40
    assert "Traceback" not in small.logs()
