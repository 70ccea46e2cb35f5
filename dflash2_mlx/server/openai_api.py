"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Responses follow OpenAI's objects and add llama.cpp's `timings` (with `tokens_per_cycle`)
at the top level, where benchmark harnesses look for them. Streams are SSE chunks ending
with `data: [DONE]`; `stream_options.include_usage` adds a last chunk with `usage`.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from .._version import __version__
from . import dispatch, reasoning, tools
from .dispatch import ServerState, StateDep
from .errors import APIError, error_body
from .schema import ChatCompletionRequest, CompletionRequest
from .worker import Job, JobFailed

router = APIRouter(prefix="/v1", tags=["openai"])

FINGERPRINT = f"dflash2-{__version__}"


def _usage(job: Job) -> dict:
    s = job.stats
    return {"prompt_tokens": s.prompt_n, "completion_tokens": s.predicted_n,
            "total_tokens": s.prompt_n + s.predicted_n,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


def _head(job: Job, state: ServerState, kind: str, created: int) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{job.id}", "object": kind, "created": created, "model": state.model_name,
            "system_fingerprint": FINGERPRINT}


def _messages(body: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages → the role/content dicts chat templates expect (with tool calls and
    tool results where given)."""
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return tools.template_messages(out)


def _tool_setup(state: ServerState, body: ChatCompletionRequest) -> tuple[list[dict] | None, str]:
    """(the tools to render and parse, None for plain chat; the resolved tool_choice); 400s
    for bad ones."""
    if body.tools:
        tools.check_tools(body.tools)
    choice = tools.resolve_tool_choice(body.tool_choice, body.tools)
    if body.parallel_tool_calls is not None and not body.tools:
        raise APIError(400, "parallel_tool_calls was given without tools", "invalid_value", "parallel_tool_calls")
    if not body.tools or choice == "none":
        return None, choice
    tools.check_model_tools(state.session.target.tokenizer, state.model_name)
    return body.tools, choice


def _token_text(state: ServerState, token: int) -> str:
    with state.encode_lock:  # the tokenizer is shared with request threads
        return state.session.target.tokenizer.decode([token])


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for, also when it holds only part of a character (where its
    decoded text is U+FFFD): byte-level BPE maps each piece character back to a byte, and
    SentencePiece spells raw bytes `<0xNN>` (mlx-lm's detokenizers read pieces the same way)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

    kind = type(tokenizer.detokenizer)
    piece = tokenizer.convert_ids_to_tokens(token)
    if kind is BPEStreamingDetokenizer and isinstance(piece, str):
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    if kind is SPMStreamingDetokenizer and isinstance(piece, str):
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token]).encode()


def _chat_logprobs(state: ServerState, lps) -> dict | None:
    """OpenAI chat `logprobs`: each token with its log-probability, bytes and alternatives."""
    if lps is None:
        return None
    tokenizer = state.session.target.tokenizer

    def entry(token: int, logprob: float) -> dict:
        text = _token_text(state, token)
        with state.encode_lock:
            raw = token_bytes(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in lps], "refusal": None}


def _completion_logprobs(state: ServerState, lps, offset: int = 0) -> dict | None:
    """OpenAI legacy completions `logprobs`: parallel lists of tokens, logprobs, alternatives, offsets."""
    if lps is None:
        return None
    tokens = [_token_text(state, x.token) for x in lps]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_token_text(state, t): lp for t, lp in x.top} for x in lps], "text_offset": offsets}


def _reasoning_chunk(text: str) -> dict:
    return {"index": 0, "delta": {"reasoning_content": text}, "logprobs": None, "finish_reason": None}


async def _sse(job: Job, chunk, final, include_usage: bool, head: dict, calls=None, split=None):
    """SSE data lines: reasoning (`reasoning_content`, when `split` separates it) and content
    chunks (tool calls as their own deltas when `calls` collects them), the finish chunk with
    timings, usage, [DONE]."""
    finish = None
    try:
        async for event in job.events():
            finish = event.finish_reason or finish
            content = ""
            for kind, text in reasoning.pieces(split, event.text):
                if kind == reasoning.REASONING:
                    yield json.dumps({**head, "choices": [_reasoning_chunk(text)]})
                else:
                    content += text
            items = calls.events(content) if calls is not None else [content]
            text = "".join(i for i in items if isinstance(i, str))
            if text or event.logprobs:
                yield json.dumps({**head, "choices": [chunk(text, None, event.logprobs)]})
            for delta in calls.deltas(items) if calls is not None else ():
                yield json.dumps({**head, "choices": [delta]})
        held = reasoning.pieces(split, "", final=True)
        for kind, text in held:
            if kind == reasoning.REASONING:
                yield json.dumps({**head, "choices": [_reasoning_chunk(text)]})
        tail = "".join(t for k, t in held if k == reasoning.CONTENT)
        items = ([tail] if tail else []) if calls is None else calls.events(tail) + calls.finish_events()
        text = "".join(i for i in items if isinstance(i, str))
        if text:
            yield json.dumps({**head, "choices": [chunk(text, None)]})
        for delta in calls.deltas(items) if calls is not None else ():
            yield json.dumps({**head, "choices": [delta]})
    except JobFailed as e:
        yield json.dumps(error_body("/v1", dispatch.failure_error(e)))
        yield "[DONE]"
        return
    yield json.dumps({**head, "choices": [final(finish)], "timings": job.stats.timings()})
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": _usage(job), "timings": job.stats.timings()})
    yield "[DONE]"


def _stream_response(state: ServerState, job: Job, chunks) -> EventSourceResponse:
    grace = state.config.shutdown_timeout
    return EventSourceResponse(dispatch.guarded(state, job, chunks), sep="\n", shutdown_grace_period=grace,
                              ping=state.config.heartbeat)


async def _response_format(state: ServerState, body: ChatCompletionRequest):
    """The grammar constraint `response_format` asks for, or None for plain text."""
    fmt = body.response_format
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return await dispatch.json_constraint(state, None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be {'name': ..., 'schema': {...}}", "invalid_value",
                           "response_format.json_schema")
        return await dispatch.json_constraint(state, spec.get("schema", {}), "response_format.json_schema.schema")
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   "invalid_value", "response_format.type")


def _prepare(state: ServerState, body, ids: list[int], endpoint: str, top_logprobs: int | None = None,
             constraint=None) -> Job:
    dispatch.check_prompt(state, ids)
    requested = getattr(body, "max_completion_tokens", None)
    name = "max_completion_tokens" if requested is not None else "max_tokens"
    if body.max_tokens is not None:
        dispatch.max_tokens(state, body.max_tokens)  # both limits must respect the cap
    requested = requested if requested is not None else body.max_tokens
    n_max = dispatch.max_tokens(state, requested, name=name)
    n_max = dispatch.fit_context(state, len(ids), n_max, explicit=requested is not None, name=name)
    params = dispatch.sampling(state, temperature=body.temperature, seed=body.seed, top_p=body.top_p,
                               top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                               presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    return dispatch.submit(state, ids, params, n_max, dispatch.stop_list(body.stop), endpoint, top_logprobs,
                           constraint)


@router.post("/chat/completions", summary="Chat completion (OpenAI)")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    tool_list, choice = _tool_setup(state, body)
    template = dispatch.template_kwargs(state, reasoning_effort=body.reasoning_effort,
                                        extra=body.chat_template_kwargs,
                                        think_field="chat_template_kwargs.enable_thinking")
    if tool_list:
        template["tools"] = tool_list
    ids = await dispatch.encode(state, _messages(body), raw=False, template=template)
    constraint = await _response_format(state, body)
    if constraint is not None and tool_list:
        raise APIError(400, "response_format json with tools is not supported (the call format has its own "
                            "grammar)", "unsupported_parameter", "response_format")
    if constraint is None:  # tool_choice "required" / a named function: the call is constrained
        constraint = await tools.forced_call_constraint(state, tool_list, choice, body.parallel_tool_calls is not False)
    job = _prepare(state, body, ids, "chat", (body.top_logprobs or 0) if body.logprobs else None, constraint)
    created = int(time.time())
    calls = tools.CallCollector(state.session.target.tokenizer, tool_list, body.parallel_tool_calls is not False,
                                forced=choice not in ("auto", "none"))
    split = reasoning.ReasoningSplit.for_prompt(state.session.target.tokenizer, ids)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = _head(job, state, "chat.completion.chunk", created)
        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}

        def chunk(text, finish, lps=None):
            return {"index": 0, "delta": {"content": text}, "logprobs": _chat_logprobs(state, lps),
                    "finish_reason": finish}

        def final(finish):
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": calls.finish_reason(finish)}

        async def chunks():
            yield json.dumps(first)
            async for line in _sse(job, chunk, final, include_usage, head, calls, split):
                yield line

        return _stream_response(state, job, chunks())
    text, _ = await dispatch.collect(request, state, job)
    thought, text = reasoning.split_all(split, text)
    content, _ = calls.feed(text)
    rest, _ = calls.finish()
    content += rest
    message = {"role": "assistant", "content": content if content or not calls.calls else None}
    if thought:
        message["reasoning_content"] = thought
    if calls.calls:
        message["tool_calls"] = [c.openai(i) for i, c in enumerate(calls.calls)]
        for c in message["tool_calls"]:
            c.pop("index")  # the index belongs to stream deltas only
    return {
        **_head(job, state, "chat.completion", created),
        "choices": [{"index": 0, "message": message,
                     "logprobs": _chat_logprobs(state, job.logprobs if job.top_logprobs is not None else None),
                     "finish_reason": calls.finish_reason(job.stats.finish_reason)}],
        "usage": _usage(job),
        "timings": job.stats.timings(),
    }


async def _completion_ids(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await dispatch.encode(state, prompt, raw=True)
    return list(prompt)


@router.post("/completions", summary="Text completion (OpenAI)")
async def completions(body: CompletionRequest, request: Request, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    ids = await _completion_ids(state, body.prompt)
    job = _prepare(state, body, ids, "completions", body.logprobs)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = _head(job, state, "text_completion", created)

        emitted = [0]  # characters of the tokens streamed so far: text_offset runs across chunks

        def chunk(text, finish, lps=None):
            logprobs = _completion_logprobs(state, lps, emitted[0])
            if logprobs is not None:
                emitted[0] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if lps else emitted[0]
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

        return _stream_response(state, job, _sse(job, chunk, lambda f: chunk("", f), include_usage, head))
    text, _ = await dispatch.collect(request, state, job)
    return {
        **_head(job, state, "text_completion", created),
        "choices": [{"index": 0, "text": text, "finish_reason": job.stats.finish_reason,
                     "logprobs": _completion_logprobs(state, job.logprobs if job.top_logprobs is not None else None)}],
        "usage": _usage(job),
        "timings": job.stats.timings(),
    }


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dflash2",
            "speculation": dispatch.speculation_info(state)}


@router.api_route("/models", methods=["GET", "HEAD"], summary="The loaded model (OpenAI)")
async def list_models(state: StateDep):
    return {"object": "list", "data": [_model_card(state)]}


@router.api_route("/models/{model:path}", methods=["GET", "HEAD"], summary="One model (OpenAI)")
async def get_model(model: str, state: StateDep):
    dispatch.check_model(state, model)
    return _model_card(state)
