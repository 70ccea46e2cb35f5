"""Request bodies of the OpenAI and Ollama routes, with an explicit bound on every field.

Unknown fields are ignored (clients send many optional ones); known fields with the wrong
type or out of bounds are rejected before any work, as 400 errors naming the field and
value. Types are strict: "2" is not an integer, true is not a token id. Features we do not
implement (tools, legacy functions, images, JSON mode, Ollama options that change
sampling) are accepted by the schema but refused by `unsupported()` with a message naming
the field, never silently ignored; `n` and `best_of` are bounded to 1. Ollama's hardware
hints (num_gpu, num_thread, ...) change no output and are accepted.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TEXT_CHARS = 2_000_000  # a prompt or message of ~2 MB; token limits apply after encoding
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_TOKENS_BOUND = 1_000_000  # schema bound; the server's --max-tokens-cap applies after
SEED_BOUND = 2**63 - 1

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None
ModelName = Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]
MaxTokens = Annotated[int | None, Field(default=None, ge=1, le=MAX_TOKENS_BOUND)]
Temperature = Annotated[float | None, Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float | None, Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int | None, Field(default=None, ge=0, le=MAX_TOKENS_BOUND)]
MinP = Annotated[float | None, Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float | None, Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float | None, Field(default=None, ge=0.0, le=10.0, allow_inf_nan=False)]
Seed = Annotated[int | None, Field(default=None, ge=0, le=SEED_BOUND)]


_NO_OP_FORMS = {
    "false": {"const": False}, "zero": {"const": 0}, "empty_list": {"type": "array", "maxItems": 0},
    "empty_str": {"type": "string", "maxLength": 0}, "empty_obj": {"type": "object", "maxProperties": 0},
}


def refused(*forms: str):
    """OpenAPI for a field the server refuses (400) unless it is null or one of the no-op `forms`,
    so that schema-driven clients and fuzzers know the other values are not accepted."""

    def edit(schema: dict) -> None:
        kept = {k: schema[k] for k in ("title", "default") if k in schema}
        schema.clear()
        schema.update(kept, anyOf=[{"type": "null"}, *(_NO_OP_FORMS[f] for f in forms)],
                      description="Not supported by this server: any other value is refused with 400.")

    return edit


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# -- OpenAI --------------------------------------------------------------------------------


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class OtherPart(_Body):
    """A non-text content part (image, audio, file, tool block): accepted by the schema so the
    refusal can name its type; a malformed text part is refused here instead."""

    type: Annotated[str, Field(max_length=64)]

    @field_validator("type")
    @classmethod
    def _not_text(cls, value: str) -> str:
        if value == "text":  # a text part whose `text` is missing or not a string
            raise ValueError("a 'text' part needs a string field 'text'")
        return value


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart | OtherPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]
    tool_calls: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=MAX_MESSAGES)]
    tool_call_id: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: ModelName
    max_tokens: MaxTokens
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    min_p: MinP
    presence_penalty: Penalty
    frequency_penalty: Penalty
    repetition_penalty: RepetitionPenalty
    seed: Seed
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(default=1, ge=1, le=1, description="Only 1: one choice per request.")]
    logit_bias: Annotated[dict[str, float] | None, Field(default=None, json_schema_extra=refused("empty_obj"))]
    user: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]

    def unsupported(self) -> str | None:
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(default=None, ge=0, le=20)]
    tools: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=128)]
    tool_choice: Annotated[Literal["none", "auto", "required"] | dict[str, Any] | None,
                           Field(default=None, description="'none', 'auto', or (refused: needs constrained "
                                                           "decoding) 'required' / a named function.")]
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[dict[str, Any]] | None, Field(default=None, json_schema_extra=refused("empty_list"))]
    function_call: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    reasoning_effort: Annotated[str | None, Field(default=None, max_length=32)]
    response_format: Annotated[dict[str, Any] | None, Field(default=None, description="{'type': 'text' | "
                               "'json_object' | 'json_schema', 'json_schema': {'name', 'schema', 'strict'}}: "
                               "output constrained by the grammar inside speculation.")]
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.functions or self.function_call is not None:
            return "functions / function_call (legacy function calling) are not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for part in message.content:
                    if part.type != "text":
                        return f"messages[{i}] has a {part.type!r} part; only text is supported"
        return super().unsupported()


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=1_000_000)]


class CompletionRequest(_Sampling):
    prompt: PromptText | TokenIds | Annotated[list[PromptText], Field(min_length=1, max_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int | None, Field(default=None, ge=0, le=5, description="Alternatives per token "
                                          "(OpenAI's legacy completions: up to 5).")]
    echo: Annotated[bool | None, Field(default=False, json_schema_extra=refused("false"))]
    suffix: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS,
                                        json_schema_extra=refused("empty_str"))]
    best_of: Annotated[int | None, Field(default=None, ge=1, le=1, description="Only 1.")]

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix (fill-in-the-middle) is not supported"
        return super().unsupported()


# -- OpenAI Responses -------------------------------------------------------------------------


class ResponsesRequest(_Body):
    """POST /v1/responses; items and tools are checked by `responses.py`, which names the bad one."""

    model: ModelName
    input: Text | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    tools: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=128)]
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens
    temperature: Temperature
    top_p: TopP
    top_logprobs: Annotated[int | None, Field(default=None, ge=0, le=20)]
    stream: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]
    store: bool | None = None
    include: Annotated[list[str] | None, Field(default=None, max_length=32)]
    metadata: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        return None


# -- Ollama --------------------------------------------------------------------------------


class OllamaOptions(_Body):
    num_predict: Annotated[int | None, Field(default=None, ge=-2, le=MAX_TOKENS_BOUND)]
    temperature: Temperature
    top_p: TopP
    top_k: TopK
    min_p: MinP
    seed: Annotated[int | None, Field(default=None, ge=-(2**31), le=SEED_BOUND)]
    stop: Stop = None
    repeat_penalty: RepetitionPenalty
    presence_penalty: Penalty
    frequency_penalty: Penalty
    repeat_last_n: Annotated[int | None, Field(default=None, ge=-1, le=MAX_TOKENS_BOUND)]
    num_ctx: Annotated[int | None, Field(default=None, ge=1, le=MAX_TOKENS_BOUND)]
    mirostat: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    mirostat_eta: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    mirostat_tau: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    tfs_z: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    typical_p: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    num_keep: Annotated[Any, Field(default=None, json_schema_extra=refused())]
    penalize_newline: Annotated[Any, Field(default=None, json_schema_extra=refused())]

    def unsupported(self) -> str | None:
        for name in ("mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "typical_p", "num_keep",
                     "penalize_newline"):
            if getattr(self, name) is not None:
                return f"options.{name} is not supported by this server"
        return None


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: Annotated[list[str] | None, Field(default=None, json_schema_extra=refused("empty_list"))]
    tool_calls: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=MAX_MESSAGES)]
    tool_name: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|ms|m|s))+$")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}


def keep_alive_seconds(value) -> float:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m");
    negative means forever. An unparsable value raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration like '5m' or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body.replace(".", "", 1).isdigit():
        return sign * float(body)
    if not _DURATION.match(body):
        raise ValueError(f"keep_alive must be a duration like '5m' or a number of seconds, got {value!r}")
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", body))


class _OllamaBody(_Body):
    model: ModelName
    stream: bool = True
    format: Annotated[Literal["", "json"] | dict[str, Any] | None,
                      Field(default=None, description="'json' or a JSON schema: output constrained by the grammar "
                                                      "inside speculation.")]
    options: OllamaOptions | None = None
    keep_alive: Annotated[str | int | float | None,
                          Field(default=None, json_schema_extra={"not": {"enum": [0, "0", "0s", "0m", "0h"]}})]
    think: bool | None = None

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value):
        if value is not None:
            keep_alive_seconds(value)  # raises ValueError with the bad value → 400
        return value

    def unsupported(self) -> str | None:
        if self.keep_alive is not None and keep_alive_seconds(self.keep_alive) == 0:
            return ("keep_alive 0 asks to unload the model; this server keeps its one model loaded "
                    "while it runs")
        return self.options.unsupported() if self.options is not None else None


class OllamaGenerateRequest(_OllamaBody):
    prompt: Text = ""
    system: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    raw: bool = False
    images: Annotated[list[str] | None, Field(default=None, json_schema_extra=refused("empty_list"))]
    suffix: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS,
                                        json_schema_extra=refused("empty_str"))]
    template: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS,
                                          json_schema_extra=refused("empty_str"))]
    context: Annotated[list[int] | None, Field(default=None, json_schema_extra=refused("empty_list"))]

    def unsupported(self) -> str | None:
        if self.images:
            return "images are not supported"
        if self.suffix:
            return "suffix (fill-in-the-middle) is not supported"
        if self.template:
            return "a per-request template is not supported; the model's chat template is used"
        if self.context:
            return "context is not supported; send the conversation to /api/chat"
        return super().unsupported()


class OllamaChatRequest(_OllamaBody):
    messages: Annotated[list[OllamaMessage], Field(default_factory=list, max_length=MAX_MESSAGES)]
    tools: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=128)]

    def unsupported(self) -> str | None:
        if any(m.images for m in self.messages):
            return "images are not supported"
        return super().unsupported()


class OllamaShowRequest(_Body):
    model: ModelName
    name: ModelName
    verbose: bool = False


# -- Anthropic -----------------------------------------------------------------------------


class AnthropicText(_Body):
    type: Literal["text"]
    text: Text


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(max_length=MAX_MODEL_CHARS)]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    input: dict[str, Any]


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(max_length=MAX_MODEL_CHARS)]
    content: Text | Annotated[list[AnthropicText], Field(max_length=MAX_MESSAGES)] = ""
    is_error: bool = False


class AnthropicThinking(_Body):
    """A thinking block of an earlier assistant turn: accepted and left out of the prompt (chat
    templates drop past reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


class AnthropicOther(OtherPart):
    """Any other block (image, document, ...): refused by name; a malformed known block is
    refused here."""

    @field_validator("type")
    @classmethod
    def _not_known(cls, value: str) -> str:
        if value in ("tool_use", "tool_result"):
            raise ValueError(f"a {value!r} block needs its fields (tool_use: id, name, input; tool_result: "
                             "tool_use_id, content)")
        return value


class AnthropicMessage(_Body):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages between turns
    content: Text | Annotated[list[AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinking
                                   | AnthropicOther], Field(max_length=MAX_MESSAGES)]


class _AnthropicPrompt(_Body):
    model: ModelName
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Annotated[list[AnthropicText], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[dict[str, Any]] | None, Field(default=None, max_length=128)]
    tool_choice: dict[str, Any] | None = None
    thinking: Annotated[dict[str, Any] | None, Field(default=None, description="{'type': 'enabled' | 'adaptive' | "
                                                     "'disabled', 'budget_tokens'}: the model's thinking mode when "
                                                     "its chat template has one; a model without one answers "
                                                     "without thinking.")]

    def unsupported(self) -> str | None:
        kind = (self.thinking or {}).get("type", "disabled")
        if kind not in ("enabled", "adaptive", "disabled"):
            return f"thinking.type must be enabled, adaptive or disabled, got {kind!r}"
        budget = (self.thinking or {}).get("budget_tokens")
        if budget is not None and (type(budget) is not int or budget < 1):
            return f"thinking.budget_tokens must be a whole number of tokens >= 1, got {budget!r}"
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for block in message.content:
                    if block.type not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                        return f"messages[{i}] has a {block.type!r} block; only text and tool blocks are supported"
        return None


class MessagesRequest(_AnthropicPrompt):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)]
    stop_sequences: Annotated[list[StopText] | None, Field(default=None, max_length=MAX_STOP)]
    stream: bool = False
    temperature: Annotated[float | None, Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)]
    top_p: TopP
    top_k: TopK
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_AnthropicPrompt):
    pass
