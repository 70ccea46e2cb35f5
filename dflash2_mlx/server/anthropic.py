"""Anthropic-compatible routes: POST /v1/messages (streamed or not), /v1/messages/count_tokens.

Local coding agents speak this API (Claude Code first). Requests carry `x-api-key` (accepted like
a bearer key), a `system` prompt, `messages` of text, tool_use and tool_result blocks, `tools` /
`tool_choice` and `stop_sequences`; replies are `message` objects with text and tool_use
blocks, `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`) and `usage`;
streams are Anthropic's named SSE events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`), and a job
that fails mid-stream ends with an `error` event. Errors use Anthropic's error shape.

What Claude Code sends and how it is taken:

* `system` messages between turns are merged, in order, after the `system` prompt: chat
  templates take one system message, at the start.
* The `x-anthropic-billing-header: ...` system block is dropped: it changes on every request
  in interactive sessions and, first in the prompt, would defeat the prefix cache.
* `max_tokens` above `--max-tokens-cap` or the room left in the context window is clamped, not
  refused; the `x-dflash2-max-tokens` header says `granted; asked=N` when it was.
* A prompt over the window is refused as Anthropic does ("prompt is too long: N tokens > M
  maximum"), the wording Claude Code answers by compacting the conversation.
* `thinking` sets the model's thinking mode when its chat template has one; a model without one
  answers without thinking blocks. `budget_tokens` is a hard cap: past it the thinking span is
  closed (its end marker forced, inside speculation), and the answer follows. Any budget of at
  least 1 is taken (Anthropic asks for 1,024 or more; a local model may want less).
* Tools with `defer_loading` are left out (the tool-search they wait for does not exist here).
* Ignored on purpose, having no meaning on a local server: `metadata`, `output_config`,
  `context_management`, `cache_control` (the prefix cache works without it), and the
  `anthropic-beta` / `anthropic-version` headers.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from . import dispatch, reasoning, tools
from .dispatch import ServerState, StateDep
from .errors import APIError, error_body
from .schema import CountTokensRequest, MessagesRequest
from .worker import IDLE, Job, JobFailed

router = APIRouter(prefix="/v1", tags=["anthropic"])


BILLING_HEADER = "x-anthropic-billing-header"


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content if block.type == "text")


def _system_text(body) -> str | None:
    """The system prompt: `system` (without the billing-header block), then every system message."""
    parts = []
    if isinstance(body.system, str):
        parts.append(body.system)
    elif body.system is not None:
        parts.append("".join(b.text for b in body.system if not b.text.startswith(BILLING_HEADER)))
    parts += [_text(m.content) for m in body.messages if m.role == "system"]
    text = "\n\n".join(p for p in parts if p)
    return text or None


def _template_messages(body) -> list[dict]:
    """Anthropic messages → template dicts: tool_use blocks become the assistant's tool calls,
    tool_result blocks become `tool` messages (before the user's own text)."""
    out = []
    for m in body.messages:
        if m.role == "system":
            continue  # merged into the system prompt (`_system_text`)
        blocks = [] if isinstance(m.content, str) else m.content
        for b in blocks:
            if b.type == "tool_result":
                result = b.content if isinstance(b.content, str) else _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        msg = {"role": m.role, "content": _text(m.content)}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if b.type == "tool_use"]
        if calls:
            msg["tool_calls"] = calls
        if msg["content"] or calls or not any(b.type == "tool_result" for b in blocks):
            out.append(msg)
    return tools.template_messages(out)


_CHOICES = {"auto": "auto", "none": "none", "any": "required"}


def _tools(state: ServerState, body) -> tuple[list[dict] | None, str]:
    """(Anthropic tools (`name`, `description`, `input_schema`) in the OpenAI form templates
    take, or None; the resolved tool_choice)."""
    choice = body.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in _CHOICES:
            choice = _CHOICES[kind]
        else:
            raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "invalid_value",
                           "tool_choice")
    as_openai = None
    offered = [t for t in body.tools or [] if not t.get("defer_loading")]
    if offered:
        as_openai = []
        for i, t in enumerate(offered):
            if not isinstance(t.get("input_schema", {}), dict):
                raise APIError(400, f"tools[{i}].input_schema must be a JSON schema object", "invalid_value",
                               f"tools[{i}].input_schema")
            fn = {"name": t.get("name"), "description": t.get("description", ""),
                  "parameters": t.get("input_schema", {})}
            as_openai.append({"type": "function", "function": fn})
        try:
            tools.check_tools(as_openai)
        except APIError as e:  # name Anthropic's own field, not the OpenAI form's
            raise APIError(400, e.message.replace(".function.name", ".name"), "invalid_value", e.param) from None
    resolved = tools.resolve_tool_choice(choice, as_openai)
    if resolved == "none" or not as_openai:
        return None, resolved
    tools.check_model_tools(state.session.target.tokenizer, state.model_name)
    return as_openai, resolved


def _thinking(state: ServerState, body) -> dict:
    """Template variables for `thinking`: the thinking mode, when the model's template has one
    (off unless the request asks for it, as Anthropic's API has it)."""
    kind = (body.thinking or {}).get("type", "disabled")
    template = getattr(state.session.target.tokenizer, "chat_template", None) or ""
    if "enable_thinking" not in str(template):
        return {}
    return {"enable_thinking": kind != "disabled"}


def _budget(body) -> int | None:
    """`thinking.budget_tokens` when thinking is on: a hard cap on the thinking span's tokens."""
    thinking = body.thinking or {}
    return thinking.get("budget_tokens") if thinking.get("type", "disabled") == "enabled" else None


def _shows_thinking(body) -> bool:
    """Whether the reply carries the thinking text (`display: "omitted"` asks for none)."""
    thinking = body.thinking or {}
    return thinking.get("type", "disabled") != "disabled" and thinking.get("display") != "omitted"


async def _prompt_ids(state: ServerState, body, tool_list: list[dict] | None) -> list[int]:
    template = _thinking(state, body) | ({"tools": tool_list} if tool_list else {})
    return await dispatch.encode(state, _template_messages(body), raw=False, system=_system_text(body),
                                 template=template or None)


def _output_budget(state: ServerState, n_prompt: int, asked: int) -> tuple[int, dict]:
    """(max tokens granted, response headers): `asked` clamped to the cap and the room in the window;
    a prompt with no room left is refused in Anthropic's words."""
    limit = min(state.max_prompt_tokens, state.context_window - 1)
    if n_prompt > limit:
        raise APIError(400, f"prompt is too long: {n_prompt} tokens > {limit} maximum", "context_length_exceeded",
                       "messages")
    granted = min(asked, state.config.max_tokens_cap, state.context_window - n_prompt)
    return granted, ({"x-dflash2-max-tokens": f"{granted}; asked={asked}"} if granted < asked else {})


def _stop_reason(job: Job, calls=None) -> str:
    s = job.stats
    if s.finish_reason == "length":
        return "max_tokens"
    if calls is not None and calls.calls:
        return "tool_use"
    return "stop_sequence" if s.stop_sequence is not None else "end_turn"


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": call.arguments}


def _usage(job: Job) -> dict:
    s = job.stats  # as Anthropic's prompt caching: input_tokens excludes the tokens read from the cache
    return {"input_tokens": s.prompt_n - s.cached_tokens, "output_tokens": s.predicted_n,
            "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}


def _message(job: Job, state: ServerState, content: list, final: bool, calls=None) -> dict:
    return {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": _stop_reason(job, calls) if final else None,
            "stop_sequence": job.stats.stop_sequence if final else None,
            "usage": _usage(job) if final else {"input_tokens": len(job.prompt_ids), "output_tokens": 0}}


def _event(name: str, data: dict) -> dict:
    return {"event": name, "data": json.dumps({"type": name, **data})}


async def _events(state: ServerState, job: Job, calls, split, show_thinking: bool):
    """Named SSE events; reasoning streams into a thinking block (when shown), text into a text
    block, and each tool call is a tool_use block whose input streams as input_json_delta pieces
    as the model writes them."""
    yield _event("message_start", {"message": _message(job, state, [], final=False)})
    blocks = _Blocks()
    try:
        async for event in job.events(idle=state.config.heartbeat):
            if event is IDLE:
                yield _event("ping", {})
                continue
            for e in _pieces(blocks, calls, reasoning.pieces(split, event.text), show_thinking):
                yield e
        for e in _pieces(blocks, calls, reasoning.pieces(split, "", final=True), show_thinking, final=True):
            yield e
    except JobFailed as e:
        yield {"event": "error", "data": json.dumps(error_body("/v1/messages", dispatch.failure_error(e)))}
        return
    if blocks.index < 0 or blocks.open == "thinking" and not calls.calls and blocks.index == 0:
        # an empty reply (or one that only thought) still has its text block, as non-streamed replies do
        for e in blocks.text(""):
            yield e
    for e in blocks.close():
        yield e
    yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(job, calls),
                                             "stop_sequence": job.stats.stop_sequence},
                                   "usage": _usage(job)})
    yield _event("message_stop", {})


def _pieces(blocks, calls, pieces: list, show_thinking: bool, final: bool = False):
    content = ""
    for kind, text in pieces:
        if kind == reasoning.REASONING:
            if show_thinking:
                yield from blocks.thinking(text)
        else:
            content += text
    yield from blocks.feed(calls.events(content) + (calls.finish_events() if final else []))


class _Blocks:
    """Content-block bookkeeping of one streamed message: which block is open, its index."""

    def __init__(self):
        self.index, self.open = -1, None

    def close(self):
        if self.open == "thinking":  # thinking made here carries no Anthropic signature
            yield _event("content_block_delta", {"index": self.index,
                                                 "delta": {"type": "signature_delta", "signature": ""}})
        if self.open is not None:
            yield _event("content_block_stop", {"index": self.index})
            self.open = None

    def thinking(self, text: str):
        if self.open != "thinking":
            yield from self.close()
            self.index, self.open = self.index + 1, "thinking"
            yield _event("content_block_start", {"index": self.index, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}})
        yield _event("content_block_delta", {"index": self.index,
                                             "delta": {"type": "thinking_delta", "thinking": text}})

    def text(self, text: str):
        if self.open != "text":
            yield from self.close()
            self.index, self.open = self.index + 1, "text"
            yield _event("content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}})
        if text:
            yield _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})

    def feed(self, items: list):
        """Text and `CallEvent`s, in order: a call's start opens its tool_use block, its argument
        pieces are input_json_delta events, its end closes the block."""
        for item in items:
            if isinstance(item, str):
                yield from self.text(item)
            elif item.kind == "start":
                yield from self.close()
                self.index, self.open = self.index + 1, "tool_use"
                yield _event("content_block_start", {"index": self.index,
                                                     "content_block": {**_tool_use(item.call), "input": {}}})
            elif item.kind == "args" and item.delta:
                yield _event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": item.delta}})
            elif item.kind in ("end", "cut"):
                yield from self.close()


@router.post("/messages", summary="Messages (Anthropic)")
async def messages(body: MessagesRequest, request: Request, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    tool_list, choice = _tools(state, body)
    ids = await _prompt_ids(state, body, tool_list)
    parallel = not (body.tool_choice or {}).get("disable_parallel_tool_use", False)
    constraint = await tools.forced_call_constraint(state, tool_list, choice, parallel)
    n_max, headers = _output_budget(state, len(ids), body.max_tokens)
    dispatch.check_prompt(state, ids)
    params = dispatch.sampling(state, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    job = dispatch.submit(state, ids, params, n_max, dispatch.stop_list(body.stop_sequences), "messages",
                          constraint=constraint, thinking_budget=_budget(body))
    calls = tools.CallCollector(state.session.target.tokenizer, tool_list, parallel,
                                forced=choice not in ("auto", "none"))
    split = reasoning.ReasoningSplit.for_prompt(state.session.target.tokenizer, ids)
    if body.stream:
        events = _events(state, job, calls, split, _shows_thinking(body))
        return EventSourceResponse(dispatch.guarded(state, job, events), sep="\n", ping=state.config.heartbeat,
                                   shutdown_grace_period=state.config.shutdown_timeout, headers=headers)
    text, _ = await dispatch.collect(request, state, job)
    thought, text = reasoning.split_all(split, text)
    text, _ = calls.feed(text)
    rest, _ = calls.finish()
    text += rest
    content = [{"type": "text", "text": text}] if text or not calls.calls else []
    if thought and _shows_thinking(body):
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] + content
    message = _message(job, state, content + [_tool_use(c) for c in calls.calls], final=True, calls=calls)
    return JSONResponse(message, headers=headers)


@router.post("/messages/count_tokens", summary="Count prompt tokens (Anthropic)")
async def count_tokens(body: CountTokensRequest, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    return {"input_tokens": len(await _prompt_ids(state, body, _tools(state, body)[0]))}
