"""Request bodies of the OpenAI and Ollama routes, with an explicit bound on every field.

Unknown fields are ignored (clients send many optional ones); known fields with the wrong
type or out of bounds are rejected before any work, as 400 errors naming the field and
value. Features we do not implement (logprobs, tools, images, JSON mode) are accepted by the
schema but refused by `unsupported()` with a message, never silently ignored; `n` and
`best_of` are bounded to 1.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TEXT_CHARS = 2_000_000  # a prompt or message of ~2 MB; token limits apply after encoding
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_TOKENS_BOUND = 1_000_000  # schema bound; the server's --max-tokens-cap applies after
SEED_BOUND = 2**63 - 1

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- OpenAI --------------------------------------------------------------------------------


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class OtherPart(_Body):
    """An image / audio / file part: accepted by the schema, refused as unsupported."""

    type: Annotated[str, Field(max_length=64)]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart | OtherPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]
    tool_calls: list[dict[str, Any]] | None = None


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
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    user: Annotated[str | None, Field(default=None, max_length=MAX_MODEL_CHARS)]

    def unsupported(self) -> str | None:
        if self.logprobs not in (None, False, 0):
            return f"logprobs={self.logprobs!r} is not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens
    top_logprobs: Annotated[int | None, Field(default=None, ge=0, le=20)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported by this server"
        if self.top_logprobs:
            return "top_logprobs is not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return f"response_format {self.response_format.get('type')!r} is not supported (only 'text')"
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for part in message.content:
                    if part.type != "text":
                        return f"messages[{i}] has a {part.type!r} part; only text is supported"
        return super().unsupported()


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=1_000_000)]


class CompletionRequest(_Sampling):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    echo: bool = False
    suffix: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    best_of: Annotated[int | None, Field(default=None, ge=1, le=1, description="Only 1.")]

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix (fill-in-the-middle) is not supported"
        return super().unsupported()


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


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _OllamaBody(_Body):
    model: ModelName
    stream: bool = True
    format: Any = None
    options: OllamaOptions | None = None
    keep_alive: Annotated[str | float | None, Field(default=None)]
    think: bool | None = None

    def unsupported(self) -> str | None:
        if self.format not in (None, ""):
            return "format (structured output) is not supported"
        return None


class OllamaGenerateRequest(_OllamaBody):
    prompt: Text = ""
    system: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    raw: bool = False
    images: list[str] | None = None
    suffix: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    template: Annotated[str | None, Field(default=None, max_length=MAX_TEXT_CHARS)]
    context: list[int] | None = None

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
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported by this server"
        if any(m.images for m in self.messages):
            return "images are not supported"
        return super().unsupported()


class OllamaShowRequest(_Body):
    model: ModelName
    name: ModelName
    verbose: bool = False
