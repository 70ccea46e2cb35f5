"""Anthropic-compatible routes: POST /v1/messages (streamed or not), /v1/messages/count_tokens.

Local coding agents speak this API. Requests carry `x-api-key` (accepted like a bearer key),
a `system` prompt, `messages` of text blocks and `stop_sequences`; replies are `message`
objects with text content blocks, `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`)
and `usage`; streams are Anthropic's named SSE events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`), and a job
that fails mid-stream ends with an `error` event. Errors use Anthropic's error shape.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from . import dispatch
from .dispatch import ServerState, StateDep
from .errors import error_body
from .schema import CountTokensRequest, MessagesRequest
from .worker import Job, JobFailed

router = APIRouter(prefix="/v1", tags=["anthropic"])


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


async def _prompt_ids(state: ServerState, body) -> list[int]:
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    system = _text(body.system) if body.system is not None else None
    return await dispatch.encode(state, messages, raw=False, system=system or None)


def _stop_reason(job: Job) -> str:
    s = job.stats
    if s.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if s.stop_sequence is not None else "end_turn"


def _usage(job: Job) -> dict:
    return {"input_tokens": job.stats.prompt_n, "output_tokens": job.stats.predicted_n}


def _message(job: Job, state: ServerState, content: list, final: bool) -> dict:
    return {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": _stop_reason(job) if final else None,
            "stop_sequence": job.stats.stop_sequence if final else None,
            "usage": _usage(job) if final else {"input_tokens": len(job.prompt_ids), "output_tokens": 0}}


def _event(name: str, data: dict) -> dict:
    return {"event": name, "data": json.dumps({"type": name, **data})}


async def _events(state: ServerState, job: Job):
    yield _event("message_start", {"message": _message(job, state, [], final=False)})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    try:
        async for event in job.events():
            if event.text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event.text}})
    except JobFailed as e:
        yield {"event": "error", "data": json.dumps(error_body("/v1/messages", dispatch.failure_error(e)))}
        return
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(job), "stop_sequence": job.stats.stop_sequence},
                                   "usage": {"output_tokens": job.stats.predicted_n}})
    yield _event("message_stop", {})


@router.post("/messages", summary="Messages (Anthropic)")
async def messages(body: MessagesRequest, request: Request, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    ids = await _prompt_ids(state, body)
    dispatch.check_prompt(state, ids)
    n_max = dispatch.max_tokens(state, body.max_tokens)
    n_max = dispatch.fit_context(state, len(ids), n_max, explicit=True)
    params = dispatch.sampling(state, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    job = dispatch.submit(state, ids, params, n_max, dispatch.stop_list(body.stop_sequences), "messages")
    if body.stream:
        return EventSourceResponse(dispatch.guarded(state, job, _events(state, job)), sep="\n",
                                   shutdown_grace_period=state.config.shutdown_timeout)
    text, _ = await dispatch.collect(request, state, job)
    return _message(job, state, [{"type": "text", "text": text}], final=True)


@router.post("/messages/count_tokens", summary="Count prompt tokens (Anthropic)")
async def count_tokens(body: CountTokensRequest, state: StateDep):
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    return {"input_tokens": len(await _prompt_ids(state, body))}
