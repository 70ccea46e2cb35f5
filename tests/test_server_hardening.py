"""`dflash2 serve` in real clients' hands and under abuse, against a real server process.

One server on the tiny pair, changed in two ways: a 64k context window (so long prompts are
cheap to send and slow enough to cancel), and byte-fallback tokens (so a reply can be cut
inside a UTF-8 character). It runs with small connection and timeout limits, an extra
allowed Host, one CORS origin and 16-token prefill chunks. The drain test stops it, so it
comes last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from urllib.parse import urlparse

import pytest
from test_server_harness import (
    ServerProcess,
    connect,
    metrics,
    ndjson_lines,
    open_stream,
    request,
    sse_events,
    wait_for,
    write_pair,
)

WINDOW = 65536
MAX_CONNECTIONS = 40
READ_TIMEOUT = 1.5
ORIGIN = "http://localhost:3000"
NAME = "tiny-llama"
MSG = [{"role": "user", "content": "Hello world"}]
ENDLESS = [{"role": "user", "content": "Hello why"}]  # the tiny pair's greedy reply runs past 2000 tokens


def _byte_fallback_window(target) -> None:
    """Filler tokens become the lead bytes C3.. of 2-byte UTF-8 characters; window 64k."""
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW
    (target / "config.json").write_text(json.dumps(config))
    spec = json.loads((target / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    fillers = sorted((i, t) for t, i in vocab.items() if t.startswith("<x"))
    for n, (i, token) in enumerate(fillers):
        del vocab[token]
        vocab[f"<0x{0xC3 + n:02X}>"] = i
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}
    (target / "tokenizer.json").write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, drafter = write_pair(tmp_path_factory.mktemp("pair"))
    _byte_fallback_window(target)
    return target, drafter


@pytest.fixture(scope="module")
def hard(pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "hard.log"
    env = {k: v for k, v in os.environ.items() if k != "DFLASH2_API_KEY"}
    with ServerProcess(*pair, "--max-connections", str(MAX_CONNECTIONS), "--read-timeout", str(READ_TIMEOUT),
                       "--allowed-host", "dflash.test", "--cors-origin", ORIGIN, "--prefill-chunk", "16",
                       "--max-tokens-cap", "2000", "--shutdown-timeout", "1", log_path=log, env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def byte_ids(pair) -> set[int]:
    vocab = json.loads((pair[0] / "tokenizer.json").read_text())["model"]["vocab"]
    return {i for t, i in vocab.items() if t.startswith("<0x")}


# -- 1: JSON whatever the Content-Type ----------------------------------------------------------


def test_ollama_curl_example_without_json_content_type(hard):
    body = {"model": NAME, "prompt": "Why is the sky blue?", "stream": False, "options": {"num_predict": 4}}
    if shutil.which("curl"):  # curl -d sends application/x-www-form-urlencoded, as in Ollama's docs
        done = subprocess.run(["curl", "-s", f"{hard.url}/api/generate", "-d", json.dumps(body)],
                              capture_output=True, text=True, timeout=60)
        reply = json.loads(done.stdout)
    else:
        raw = request(hard.url, "POST", "/api/generate", raw=json.dumps(body).encode(),
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert raw.status == 200, raw.body
        reply = raw.json()
    assert reply["done"] is True and reply["eval_count"] == 4 and isinstance(reply["response"], str)


def test_json_body_without_any_content_type(hard):
    # litellm's ollama_chat/ provider posts a JSON string with no Content-Type header.
    conn = connect(hard.url)
    body = json.dumps({"model": NAME, "messages": MSG, "stream": False, "options": {"num_predict": 3}}).encode()
    conn.putrequest("POST", "/api/chat")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, reply
    assert reply["message"]["role"] == "assistant" and reply["eval_count"] == 3
    bad = request(hard.url, "POST", "/api/chat", raw=b"model=x&prompt=y",
                  headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert bad.status == 400 and "malformed JSON" in bad.json()["error"]


def test_litellm_ollama_chat_provider(hard, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no model-price download at import
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(model=f"ollama_chat/{NAME}", messages=MSG, api_base=hard.url, max_tokens=3)
    assert isinstance(reply.choices[0].message.content, str)


# -- 2: prefill is cancellable ---------------------------------------------------------------


def test_disconnect_during_a_long_prefill_frees_the_worker_within_a_chunk(hard):
    url = hard.url
    prompt = [3 + i % 79 for i in range(30000)]  # 1875 chunks of 16 tokens
    before = metrics(url)
    conn = connect(url)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 1}),
                 headers={"Content-Type": "application/json"})
    assert wait_for(lambda: metrics(url)["dflash2_prefill_tokens_done"] >= 800)
    at_close = metrics(url)
    assert at_close["dflash2_prefill_tokens_total"] == len(prompt)
    conn.close()
    key = 'dflash2_jobs_total{outcome="cancelled"}'
    assert wait_for(lambda: metrics(url)[key] - before[key] == 1)
    after = metrics(url)
    assert after["dflash2_requests_running"] == 0 and after["dflash2_prefill_tokens_total"] == 0
    # The cancel is seen between chunks: a few chunks of slack for the disconnect to arrive.
    assert after["dflash2_prefill_chunks_total"] - at_close["dflash2_prefill_chunks_total"] <= 8
    assert after["dflash2_generated_tokens_total"] == before["dflash2_generated_tokens_total"]


# -- 3: read timeouts and a bounded number of sockets ------------------------------------------


def _raw_socket(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return False
    except OSError:
        return True
    return data == b"" or data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503"))


def test_idle_and_slow_sockets_are_closed_while_health_answers(hard):
    url = hard.url
    held = [_raw_socket(url) for _ in range(3 * MAX_CONNECTIONS)]
    for sock in held[::4]:  # a quarter dribble incomplete headers (slowloris)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    health = request(url, "GET", "/health", timeout=5)
    assert health.status == 200 and time.monotonic() - started < 5
    fds = len(os.listdir(f"/proc/{hard.proc.pid}/fd"))
    assert fds < MAX_CONNECTIONS + 100, fds
    time.sleep(READ_TIMEOUT + 1.0)
    still_open = [s for s in held if not _closed_by_server(s)]
    for sock in held:
        sock.close()
    assert still_open == [], f"{len(still_open)} of {len(held)} sockets still open"
    assert request(url, "GET", "/health").status == 200
    noisy = [line for line in hard.logs().splitlines() if "connection" in line.lower()]
    assert len(noisy) <= 6, noisy  # rate-limited, not one line per socket


def test_a_body_that_stalls_gets_408(hard):
    sock = _raw_socket(hard.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    sock.settimeout(READ_TIMEOUT + 5)
    reply = b""
    while data := sock.recv(4096):  # the server closes after its answer
        reply += data
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--read-timeout" in reply


# -- 4: the body limit holds for chunked bodies ----------------------------------------------


def test_chunked_body_over_the_limit_is_413(hard):
    sock = _raw_socket(hard.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)

    def send_9_mb():
        try:
            for _ in range(9 * 16):
                sock.sendall(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the upload ended

    sender = threading.Thread(target=send_9_mb)
    sender.start()
    sock.settimeout(30)
    reply = b""
    try:
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    finally:
        sender.join(30)
        sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert request(hard.url, "GET", "/health").status == 200


# -- 5: timings ------------------------------------------------------------------------------


def test_one_token_timings_are_sane(hard):
    one = request(hard.url, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1}).json()["timings"]
    assert one["predicted_n"] == 1 and one["prompt_ms"] > 0
    assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    many = request(hard.url, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 24}).json()["timings"]
    assert many["predicted_n"] == 24 and many["predicted_ms"] > 0
    assert many["predicted_per_second"] == pytest.approx(1e3 * 23 / many["predicted_ms"], rel=1e-2)
    ollama = request(hard.url, "POST", "/api/generate", {"prompt": "Hello", "stream": False,
                                                         "options": {"num_predict": 1}}).json()
    assert ollama["eval_count"] == 1 and ollama["eval_duration"] > 0 and ollama["prompt_eval_duration"] > 0
    # the one prompt pass is booked once, not as both the prompt's and the token's time
    assert ollama["prompt_eval_duration"] + ollama["eval_duration"] <= ollama["total_duration"]
    assert ollama["prompt_eval_duration"] + ollama["eval_duration"] == pytest.approx(
        ollama["timings"]["prompt_ms"] * 1e6, rel=1e-3)
    body = {"prompt": "Twelve months, cached.", "stream": False, "options": {"num_predict": 8}}
    request(hard.url, "POST", "/api/generate", body)
    cached = request(hard.url, "POST", "/api/generate", body).json()
    assert cached["timings"]["cache_n"] > 0 and cached["prompt_eval_duration"] > 0
    # a prompt the prefix cache has not seen: the first token moves out of its prompt pass at the
    # mean decode cost, or at half the pass where a fast machine made the pass shorter than two steps
    ollama = request(hard.url, "POST", "/api/generate", {"prompt": "Name twelve months, then ten rivers.",
                                                         "stream": False, "options": {"num_predict": 24}}).json()
    timed = ollama["timings"]
    assert timed["cache_n"] < ollama["prompt_eval_count"] / 2
    shift_ms = min(timed["predicted_ms"] / (ollama["eval_count"] - 1), timed["prompt_ms"] / 2)
    assert ollama["eval_duration"] == pytest.approx((timed["predicted_ms"] + shift_ms) * 1e6, abs=2e3)
    assert ollama["prompt_eval_duration"] == pytest.approx((timed["prompt_ms"] - shift_ms) * 1e6, abs=2e3)
    assert ollama["total_duration"] >= ollama["prompt_eval_duration"] + ollama["eval_duration"] * 0.98


# -- 7: Host allow-list and CORS -------------------------------------------------------------


def test_foreign_host_is_refused_and_allowed_hosts_answer(hard):
    evil = request(hard.url, "GET", "/v1/models", headers={"Host": "evil.example"})
    assert evil.status == 403 and "evil.example" in evil.json()["error"]["message"]
    assert request(hard.url, "GET", "/api/tags", headers={"Host": "evil.example:8000"}).status == 403
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "dflash.test:1234", "DFLASH.TEST"):
        assert request(hard.url, "GET", "/v1/models", headers={"Host": host}).status == 200, host


def _preflight(url: str, origin: str):
    return request(url, "OPTIONS", "/v1/chat/completions",
                   headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                            "Access-Control-Request-Headers": "authorization, content-type"})


CHAT = "/v1/chat/completions"


def test_cors_preflight_only_for_the_configured_origin(hard):
    ok = _preflight(hard.url, ORIGIN)
    assert ok.status == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    other = _preflight(hard.url, "http://evil.example")
    assert other.status == 400 and "access-control-allow-origin" not in other.headers
    simple = request(hard.url, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert simple.status == 200 and simple.headers["access-control-allow-origin"] == ORIGIN


def test_a_cross_origin_simple_post_cannot_start_a_generation(hard):
    body = json.dumps({"model": NAME, "messages": MSG, "max_tokens": 2}).encode()
    plain = {"Content-Type": "text/plain"}  # a "simple" request: no preflight in a browser
    for origin in ("http://evil.example", "null", "https://localhost.evil.example", "chrome-extension://abc"):
        refused = request(hard.url, "POST", CHAT, raw=body, headers={**plain, "Origin": origin})
        assert refused.status == 403, origin
        message = refused.json()["error"]["message"]
        assert origin in message and "--cors-origin" in message
    for origin in (ORIGIN, "http://localhost:5173", "http://127.0.0.1:8000", "http://[::1]:9", "http://dflash.test:1"):
        assert request(hard.url, "POST", CHAT, raw=body, headers={**plain, "Origin": origin}).status == 200, origin
    assert request(hard.url, "POST", CHAT, raw=body, headers=plain).status == 200  # no Origin: not a browser page
    assert request(hard.url, "GET", "/v1/models", headers={"Origin": "http://evil.example"}).status == 200


def test_a_deeply_nested_schema_is_a_400_not_a_500(hard):
    schema: dict = {"type": "string"}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": NAME, "messages": MSG, "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    reply = request(hard.url, "POST", CHAT, body)
    assert reply.status == 400 and "nests deeper" in reply.json()["error"]["message"]


# -- 8, 9, 11: fields, context window, strict types -------------------------------------------

CHAT = "/v1/chat/completions"
REFUSED = [
    ("tool_choice without tools", CHAT, {"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    ("legacy functions", CHAT, {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("legacy function_call", CHAT, {"messages": MSG, "function_call": "auto"}, "function_call"),
    ("parallel_tool_calls without tools", CHAT, {"messages": MSG, "parallel_tool_calls": True},
     "parallel_tool_calls"),
    ("reasoning_effort", CHAT, {"messages": MSG, "reasoning_effort": "high"}, "reasoning_effort"),
    ("enable_thinking", CHAT, {"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}},
     "enable_thinking"),
    ("template kwargs that the server sets", CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": False}},
     "tokenize"),
    ("ollama think", "/api/chat", {"messages": MSG, "think": True}, "think"),
    ("ollama think with raw", "/api/generate", {"prompt": "a", "raw": True, "think": False}, "think"),
    ("ollama num_ctx over the window", "/api/chat", {"messages": MSG, "options": {"num_ctx": WINDOW + 1}},
     "num_ctx"),
    ("ollama keep_alive 0", "/api/generate", {"prompt": "a", "keep_alive": 0}, "keep_alive"),
    ("ollama keep_alive garbage", "/api/generate", {"prompt": "a", "keep_alive": "soon"}, "keep_alive"),
    ("ollama mirostat", "/api/generate", {"prompt": "a", "options": {"mirostat": 2}}, "mirostat"),
    ("max_tokens a numeric string", "/v1/completions", {"prompt": "a", "max_tokens": "2"}, "max_tokens"),
    ("max_tokens a bool", "/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("bool token ids", "/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("stream a string", CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages"),
]


@pytest.mark.parametrize("name,path,body,field", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_or_mistyped_field_is_400_naming_it(hard, name, path, body, field):
    reply = request(hard.url, "POST", path, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    message = error if path.startswith("/api/") else error["message"]
    assert field in message
    for internal in ("list[", "union[", "TextPart", "OtherPart", "function-after", "pydantic"):
        assert internal not in message, message


def test_accepted_ollama_fields_are_honoured(hard):
    ok = request(hard.url, "POST", "/api/generate", {"prompt": "a", "stream": False, "keep_alive": "5m",
                                                     "think": False, "options": {"num_predict": 2, "num_thread": 4}})
    assert ok.status == 200 and ok.json()["eval_count"] == 2
    ps = request(hard.url, "GET", "/api/ps").json()["models"]
    assert ps[0]["name"] == f"{NAME}:latest" and ps[0]["expires_at"].startswith("2318")
    assert ps[0]["context_length"] == WINDOW


def test_prompt_plus_max_tokens_past_the_window_is_refused(hard):
    prompt = [3 + i % 79 for i in range(WINDOW - 10)]
    reply = request(hard.url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 100})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(WINDOW) in error["message"]


def test_ollama_num_ctx_bounds_prompt_and_output(hard):
    prompt = "abcdefghij" * 5  # 50 characters → more than 50 tokens with the template
    too_long = request(hard.url, "POST", "/api/generate", {"prompt": prompt, "raw": True, "stream": False,
                                                           "options": {"num_ctx": 64, "num_predict": 40}})
    assert too_long.status == 400 and "context window is 64" in too_long.json()["error"]
    clamped = request(hard.url, "POST", "/api/generate", {"prompt": prompt, "raw": True, "stream": False,
                                                          "options": {"num_ctx": 64}}).json()
    assert clamped["prompt_eval_count"] + clamped["eval_count"] <= 64 and clamped["done_reason"] == "length"


# -- 10: no U+FFFD at a cut ------------------------------------------------------------------


def test_reply_cut_inside_a_character_has_no_replacement_character(hard, byte_ids):
    full = request(hard.url, "POST", "/api/generate", {"prompt": "Hi there", "raw": True, "stream": False,
                                                       "options": {"num_predict": 64}}).json()
    n_prompt = full["prompt_eval_count"]
    generated = full["context"][n_prompt:]
    cut = next((k for k, t in enumerate(generated) if t in byte_ids), None)
    assert cut is not None, f"no byte token in {generated}: pick another prompt"
    for stream in (False, True):
        body = {"prompt": "Hi there", "max_tokens": cut + 1, "stream": stream}
        if stream:
            conn, resp = open_stream(hard.url, "/v1/completions", body)
            events = sse_events(resp)
            conn.close()
            text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
        else:
            text = request(hard.url, "POST", "/v1/completions", body).json()["choices"][0]["text"]
        assert not text.endswith("\ufffd"), (stream, text)
        before = request(hard.url, "POST", "/v1/completions", {"prompt": "Hi there", "max_tokens": cut}).json()
        assert text == before["choices"][0]["text"]


# -- 11: /docs offline, HEAD, /api/ps --------------------------------------------------------


def test_docs_work_offline_and_head_answers(hard):
    docs = request(hard.url, "GET", "/docs")
    assert docs.status == 200
    page = docs.body.decode()
    assert "cdn." not in page and "swagger-ui-bundle.js" in page
    src = page.split('src="')[1].split('"')[0]
    assert request(hard.url, "GET", src).status == 200
    for path in ("/health", "/v1/models", "/api/tags", "/api/version", "/api/ps", "/metrics", "/"):
        head = request(hard.url, "HEAD", path)
        assert head.status == 200 and head.body == b"", path


# -- 6: drain (stops the server: last) --------------------------------------------------------


def test_drain_answers_503_and_ends_every_open_stream_with_an_error(hard):
    url = hard.url
    results = {}

    # Greedy on a prompt whose reply from the tiny pair has no EOS in 2000 tokens: a reply that
    # ended by itself within the 1 s grace would (rightly) finish without an error.
    def sse():
        conn, resp = open_stream(url, CHAT, {"messages": ENDLESS, "max_tokens": 1900, "stream": True,
                                             "temperature": 0})
        results["sse"] = sse_events(resp)
        conn.close()

    def ndjson():
        conn, resp = open_stream(url, "/api/generate", {"prompt": ENDLESS[0]["content"],
                                                          "options": {"num_predict": 1900, "temperature": 0}})
        results["ndjson"] = ndjson_lines(resp)
        conn.close()

    threads = [threading.Thread(target=sse), threading.Thread(target=ndjson)]
    threads[0].start()
    assert wait_for(lambda: metrics(url)["dflash2_requests_running"] == 1)
    threads[1].start()  # joins the batch beside the first (the queued case: test_server_http's sigterm test)
    assert wait_for(lambda: metrics(url)["dflash2_requests_running"] == 2)
    hard.signal(signal.SIGTERM)
    time.sleep(0.3)
    busy = request(url, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert busy.status == 503 and busy.headers["retry-after"] == "5"
    health = request(url, "GET", "/health")
    assert health.status == 503 and health.json()["status"] == "shutting down"
    for t in threads:
        t.join(60)
    events = results["sse"]
    assert events[-1] == "[DONE]" and "shut down" in events[-2]["error"]["message"]
    lines = results["ndjson"]
    assert "shut" in lines[-1]["error"]  # the batched job, cut by the shutdown too
    assert hard.wait(60) == 0, hard.logs()[-4000:]
    assert "Traceback" not in hard.logs()
