"""`dflash2 serve` for agents, against a real server process on the tiny pair: Anthropic's
Messages API (the official `anthropic` SDK), log-probabilities that equal the target's own
(the OpenAI SDK), and which drafter and width policy are active."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_harness import ServerProcess, open_stream, request, write_pair

anthropic = pytest.importorskip("anthropic")

KEY = "agent-key"
NAME = "tiny-llama"
SYSTEM = "Be brief."
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "agents.log"
    with ServerProcess(*pair, "--block-size", "4", log_path=log, env={"DFLASH2_API_KEY": KEY}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(server):
    """The OpenAI route's reply to the same conversation: the same prompt tokens, greedy."""
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    reply = oa.chat.completions.create(model=NAME, max_tokens=16,
                                       messages=[{"role": "system", "content": SYSTEM}, *USER])
    return reply.choices[0].message.content, reply.usage


def test_messages_equal_the_openai_reply(client, reference):
    text, usage = reference
    msg = client.messages.create(model=NAME, max_tokens=16, system=SYSTEM, messages=USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == NAME
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == text
    # the OpenAI request ran first, so the prompt comes from the prefix cache, as Anthropic counts it
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == usage.prompt_tokens
    assert msg.usage.cache_read_input_tokens == usage.prompt_tokens - 1
    assert msg.usage.output_tokens == usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if usage.completion_tokens == 16 else "end_turn")


def test_streamed_messages_equal_the_whole_reply(client, reference):
    text, _ = reference
    with client.messages.stream(model=NAME, max_tokens=16, system=[{"type": "text", "text": SYSTEM}],
                                messages=USER) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens > 0


def test_raw_stream_events_in_order(server):
    conn, resp = open_stream(server.url, "/v1/messages", {"model": NAME, "max_tokens": 6, "messages": USER,
                                                          "stream": True}, headers={"x-api-key": KEY})
    names = [line.decode().split(":", 1)[1].strip() for line in resp.read().splitlines()
             if line.startswith(b"event:")]
    conn.close()
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) <= {"content_block_delta"}


def test_stop_sequences_report_which_one_stopped(client, reference):
    text, _ = reference
    stop = text[3:5]
    assert len(stop) == 2 and stop not in text[:4], text  # a stop string first seen at index 3
    msg = client.messages.create(model=NAME, max_tokens=16, system=SYSTEM, messages=USER,
                                 stop_sequences=["@@never@@", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


def test_count_tokens_matches_usage(client, reference):
    _, usage = reference
    counted = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=USER)
    assert counted.input_tokens == usage.prompt_tokens


def test_errors_have_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=NAME, max_tokens=8, messages=USER,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert "does not support tool calling" in str(bad.value)
    reply = request(server.url, "POST", "/v1/messages", {"model": NAME, "messages": USER},
                    headers={"x-api-key": KEY})
    assert reply.status == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    wrong = request(server.url, "POST", "/v1/messages", {"model": NAME, "max_tokens": 4, "messages": USER},
                    headers={"x-api-key": "nope"})
    assert wrong.status == 401 and wrong.json()["error"]["type"] == "authentication_error"
    image = {"role": "user", "content": [{"type": "image", "source": {}}]}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=NAME, max_tokens=8, messages=[image])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-3-opus", max_tokens=8, messages=USER)


def test_health_and_models_say_which_drafter_and_policy(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    spec = request(server.url, "GET", "/health").json()["speculation"]
    assert spec["drafter"] == "tiny-llama-dflash2" and spec["width_policy"] == "fixed 4"  # a name, no path
    assert spec["active"] is True and spec["fallback_reason"] is None
    card = request(server.url, "GET", "/v1/models", headers=auth).json()["data"][0]
    assert card["speculation"]["drafter"] == spec["drafter"]
    assert "--api-key on the command line" not in server.logs()  # the key came from the environment


# -- log-probabilities ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(pair):
    """The same target loaded here, to compute each token's true log-probability."""
    from dflash2_mlx.session import Session
    from dflash2_mlx.target import load_target

    target = load_target(str(pair[0]))
    vocab = json.loads((pair[0] / "tokenizer.json").read_text())["model"]["vocab"]
    return Session(spec=None, target=target, drafter=None, block_size=None), vocab


def _truth(session, prompt_ids, ids):
    import mlx.core as mx

    logits = session.target.model(mx.array([prompt_ids + ids]))[0, len(prompt_ids) - 1 : -1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_chat_logprobs_are_the_targets_own_streamed_or_not(server, local):
    import mlx.core as mx

    from dflash2_mlx.core.stopper import unrendered_tokens

    session, vocab = local
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    kwargs = dict(model=NAME, messages=USER, max_tokens=12, logprobs=True, top_logprobs=3)
    reply = oa.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    ids = [vocab[c.token] for c in content]
    hidden = set(unrendered_tokens(session.target.tokenizer).values())  # listed, but not in the text
    assert "".join(c.token for c in content if c.token not in hidden) == reply.choices[0].message.content
    assert len(ids) == 12
    truth = _truth(session, session.encode(USER), ids)
    for i, c in enumerate(content):
        assert abs(c.logprob - truth[i, ids[i]].item()) < 1e-4 and c.bytes == list(c.token.encode())
        assert [vocab[t.token] for t in c.top_logprobs] == mx.argsort(-truth[i])[:3].tolist()
    streamed = [lp for chunk in oa.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = oa.chat.completions.create(model=NAME, messages=USER, max_tokens=12)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_refusals(server, local):
    session, vocab = local
    prompt = [1, 40, 41, 42, 7, 19]
    reply = request(server.url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "logprobs": 2},
                    headers={"x-api-key": KEY}).json()["choices"][0]
    lp = reply["logprobs"]
    ids = [vocab[t] for t in lp["tokens"]]
    truth = _truth(session, prompt, ids)
    assert all(abs(v - truth[i, ids[i]].item()) < 1e-4 for i, v in enumerate(lp["token_logprobs"]))
    assert all(len(top) == 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    bad = request(server.url, "POST", "/v1/chat/completions", {"messages": USER, "top_logprobs": 2},
                  headers={"x-api-key": KEY})
    assert bad.status == 400 and "logprobs" in bad.json()["error"]["message"]
    too_many = request(server.url, "POST", "/v1/completions", {"prompt": "a", "logprobs": 6},
                       headers={"x-api-key": KEY})
    assert too_many.status == 400 and "logprobs" in too_many.json()["error"]["message"]
