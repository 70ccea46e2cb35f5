"""Structured output through a real `dflash2 serve` process: `response_format` (OpenAI, with
`client.chat.completions.parse` and a Pydantic model) and Ollama's `format`, constrained by the
grammar inside speculation. Every reply parses against its schema and equals the reply of a
server decoding plainly (`--drafter none`); bad schemas are 400s in each API's shape."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel
from test_server_harness import ServerProcess, request, write_pair

pytest.importorskip("llguidance")

NAME = "tiny-llama"
ASK = [{"role": "user", "content": "Is water wet? Answer in JSON."}]


class Answer(BaseModel):
    yes: bool
    n: int


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("bytepair"), byte_level=True)


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with ServerProcess(*pair, "--block-size", "4", log_path=logs / "spec.log") as spec, \
            ServerProcess(pair[0], "none", log_path=logs / "plain.log") as plain:
        yield spec, plain


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_equals_plain_decoding(servers):
    spec, plain = servers
    replies = [_client(s).chat.completions.parse(model=NAME, messages=ASK, response_format=Answer, max_tokens=200)
               for s in (spec, plain)]
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(reply.choices[0].message.parsed, Answer)
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_json_object_and_streaming(servers):
    spec, plain = servers
    body = dict(model=NAME, messages=ASK, response_format={"type": "json_object"}, max_tokens=200)
    whole = _client(spec).chat.completions.create(**body)
    text = whole.choices[0].message.content
    assert text.startswith("{")
    if whole.choices[0].finish_reason == "stop":  # a random model may spend 200 tokens inside one string
        assert isinstance(json.loads(text), dict)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in _client(spec).chat.completions.create(**body, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content
    assert _client(plain).chat.completions.create(**body).choices[0].message.content == streamed


def test_ollama_format_schema(servers):
    ollama = pytest.importorskip("ollama")
    spec, plain = servers
    schema = {**Answer.model_json_schema(), "additionalProperties": False}  # else a random model adds keys forever
    replies = [ollama.Client(host=s.url, timeout=120).chat(model=NAME, messages=ASK, format=schema,
                                                           options={"num_predict": 200}) for s in servers]
    assert replies[0].message.content == replies[1].message.content
    Answer.model_validate_json(replies[0].message.content)
    generated = ollama.Client(host=spec.url, timeout=120).generate(model=NAME, prompt="JSON please", format="json",
                                                                   options={"num_predict": 50})
    assert generated.response.startswith("{")


DEEP = {"type": "object"}
for _ in range(30):
    DEEP = {"type": "object", "properties": {"x": DEEP}}


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": DEEP}}, "deeper than"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["x" * 70000]}}}, "at most"),
    ({"type": "json_schema", "json_schema": "nope"}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_schemas_are_400s(servers, fmt, words):
    spec, _ = servers
    reply = request(spec.url, "POST", "/v1/chat/completions",
                    {"model": NAME, "messages": ASK, "max_tokens": 4, "response_format": fmt})
    assert reply.status == 400, reply.text
    assert words in reply.json()["error"]["message"]
    bad = request(spec.url, "POST", "/api/chat", {"model": NAME, "messages": ASK, "stream": False,
                                                   "format": {"type": "nonsense"}})
    assert bad.status == 400 and "invalid JSON schema" in bad.json()["error"]
    assert request(spec.url, "GET", "/health").status == 200
