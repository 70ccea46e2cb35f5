"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streams), /api/tags, /api/show,
/api/version.

Lines carry Ollama's fields (`model`, `created_at`, `response` or `message`, `done`,
`done_reason`) and its nanosecond durations and counts (`total_duration`, `load_duration`,
`prompt_eval_count`, `prompt_eval_duration`, `eval_count`, `eval_duration`); the last line
also has llama.cpp's `timings`. Ollama streams by default (`"stream": false` for one object).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .._version import __version__
from . import dispatch, reasoning, tools
from .dispatch import ServerState, StateDep
from .errors import APIError
from .schema import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions, OllamaShowRequest
from .worker import Job, JobFailed

router = APIRouter(prefix="/api", tags=["ollama"])
NEVER = "2318-08-01T00:00:00Z"  # far future, as Ollama reports for keep_alive < 0 (now + Go's longest duration)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _done_fields(job: Job, started: float, finish: str | None) -> dict:
    s = job.stats
    prompt_ms, eval_ms = s.ollama_durations_ms()
    return {
        "done": True,
        "done_reason": finish or s.finish_reason or "stop",
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": s.prompt_n,  # the whole prompt; timings.cache_n says how much came cached
        "prompt_eval_duration": int(prompt_ms * 1e6),
        "eval_count": s.predicted_n,
        "eval_duration": int(eval_ms * 1e6),
        "timings": s.timings(),
    }


def _window(state: ServerState, o: OllamaOptions) -> int:
    """The request's context window: options.num_ctx, at most the model's."""
    if o.num_ctx is None:
        return state.context_window
    if o.num_ctx > state.context_window:
        raise APIError(400, f"options.num_ctx {o.num_ctx} exceeds the model's context window of "
                            f"{state.context_window} tokens", "invalid_value", "options.num_ctx")
    return o.num_ctx


def _limits(state: ServerState, options: OllamaOptions | None, n_prompt: int):
    """(max_tokens, SamplingParams, stop) from Ollama's `options`."""
    o = options or OllamaOptions()
    if o.num_predict == 0:
        raise APIError(400, "options.num_predict must be >= 1, or -1 for the server default (got 0)",
                       "invalid_value", "options.num_predict")
    requested = o.num_predict if o.num_predict and o.num_predict > 0 else None
    n_max = dispatch.max_tokens(state, requested, name="options.num_predict")
    n_max = dispatch.fit_context(state, n_prompt, n_max, explicit=requested is not None,
                                 name="options.num_predict", window=_window(state, o))
    extra = {} if o.repeat_last_n is None or o.repeat_last_n < 1 else {"penalty_context": o.repeat_last_n}
    params = dispatch.sampling(state, temperature=o.temperature, seed=o.seed if o.seed and o.seed >= 0 else None,
                               top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, repetition_penalty=o.repeat_penalty,
                               presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty, **extra)
    return n_max, params, dispatch.stop_list(o.stop)


async def _format(state: ServerState, body):
    """Ollama's `format`: "json" (any object) or a JSON schema → a grammar constraint."""
    if body.format in (None, ""):
        return None
    return await dispatch.json_constraint(state, None if body.format == "json" else body.format, "format")


def _submit(state: ServerState, body, ids: list[int], endpoint: str, constraint=None) -> Job:
    dispatch.check_prompt(state, ids)
    n_max, params, stop = _limits(state, body.options, len(ids))
    return dispatch.submit(state, ids, params, n_max, stop, endpoint, constraint=constraint)


def _loaded(name: str, extra: dict) -> dict:
    """Ollama's answer to an empty prompt: the model is loaded, nothing is generated."""
    return {"model": name, "created_at": _now(), **extra, "done": True, "done_reason": "load"}


async def _ndjson(job: Job, piece, done_extra, started: float, calls=None, split=None):
    """NDJSON lines; reasoning (when `split` separates it) and parsed tool calls come as their own lines."""
    finish, tokens = None, []

    def lines(pieces: list, final: bool = False):
        thought, text = _joined(pieces)
        if thought:
            yield json.dumps({"created_at": _now(), **piece("", (), thought), "done": False}) + "\n"
        text, new = calls.feed(text) if calls else (text, [])
        if final and calls:
            rest, more = calls.finish()
            text, new = text + rest, [*new, *more]
        if text:
            yield json.dumps({"created_at": _now(), **piece(text), "done": False}) + "\n"
        if new:
            yield json.dumps({"created_at": _now(), **piece("", new), "done": False}) + "\n"

    try:
        async for event in job.events():
            finish = event.finish_reason or finish
            tokens.extend(event.tokens)
            for line in lines(reasoning.pieces(split, event.text)):
                yield line
        for line in lines(reasoning.pieces(split, "", final=True), final=True):
            yield line
    except JobFailed as e:
        yield json.dumps({"error": e.failure.message}) + "\n"
        return
    last = {"created_at": _now(), **piece(""), **done_extra(tokens), **_done_fields(job, started, finish)}
    yield json.dumps(last) + "\n"


def _joined(pieces: list) -> tuple[str, str]:
    return ("".join(t for k, t in pieces if k == reasoning.REASONING),
            "".join(t for k, t in pieces if k == reasoning.CONTENT))


async def _respond(request: Request, state: ServerState, body, job: Job, piece, done_extra, started: float,
                   calls=None):
    """An NDJSON stream, or (`"stream": false`) one object with the whole text (and tool calls);
    a thinking model's reasoning is the `thinking` field, never the content."""
    name = body.model or state.model_name
    split = reasoning.ReasoningSplit.for_prompt(state.session.target.tokenizer, job.prompt_ids)

    def named(text: str, new_calls=(), thought: str = "") -> dict:
        return {"model": name, **piece(text, new_calls, thought)}

    if body.stream:
        lines = _ndjson(job, named, done_extra, started, calls, split)
        return StreamingResponse(dispatch.guarded(state, job, lines), media_type="application/x-ndjson")
    text, tokens = await dispatch.collect(request, state, job)
    thought, text = reasoning.split_all(split, text)
    found = []
    if calls is not None:
        text, _ = calls.feed(text)
        rest, _ = calls.finish()
        text, found = text + rest, calls.calls
    return {"created_at": _now(), **named(text, found, thought), **done_extra(tokens),
            **_done_fields(job, started, None)}


@router.post("/generate", summary="Generate (Ollama)")
async def generate(body: OllamaGenerateRequest, request: Request, state: StateDep):
    started = time.perf_counter()
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    if not body.prompt and not body.system:
        _limits(state, body.options, 0)  # a load request's options are still checked
        return _loaded(body.model or state.model_name, {"response": ""})
    if body.raw and body.think is not None:
        raise APIError(400, "think has no effect with raw: a raw prompt skips the chat template", "invalid_value",
                       "think")
    template = dispatch.template_kwargs(state, think=body.think)
    ids = await dispatch.encode(state, body.prompt, raw=body.raw, system=body.system, template=template)
    job = _submit(state, body, ids, "generate", await _format(state, body))
    def piece(text: str, _=(), thought: str = "") -> dict:
        return {"response": text, **({"thinking": thought} if thought else {})}

    return await _respond(request, state, body, job, piece, lambda tokens: {"context": ids + tokens}, started)


@router.post("/chat", summary="Chat (Ollama)")
async def chat(body: OllamaChatRequest, request: Request, state: StateDep):
    started = time.perf_counter()
    dispatch.check_model(state, body.model)
    dispatch.check_unsupported(body)
    if not body.messages:
        _limits(state, body.options, 0)
        return _loaded(body.model or state.model_name, {"message": {"role": "assistant", "content": ""}})
    tool_list = None
    if body.tools:
        tools.check_model_tools(state.session.target.tokenizer, state.model_name)
        tool_list = tools.check_tools(body.tools)
    template = dispatch.template_kwargs(state, think=body.think)
    if tool_list:
        template["tools"] = tool_list
    ids = await dispatch.encode(state, _chat_messages(body), raw=False, template=template)
    constraint = await _format(state, body)
    if constraint is not None and tool_list:
        raise APIError(400, "format with tools is not supported (the call format has its own grammar)",
                       "unsupported_parameter", "format")
    job = _submit(state, body, ids, "chat", constraint)
    calls = tools.CallCollector(state.session.target.tokenizer, tool_list) if tool_list else None

    def piece(text: str, new_calls=(), thought: str = "") -> dict:
        message = {"role": "assistant", "content": text}
        if thought:
            message["thinking"] = thought
        if new_calls:
            message["tool_calls"] = [{"function": {"index": calls.calls.index(c), "name": c.name,
                                                   "arguments": c.arguments}} for c in new_calls]
        return {"message": message}

    return await _respond(request, state, body, job, piece, lambda tokens: {}, started, calls)


def _chat_messages(body: OllamaChatRequest) -> list[dict]:
    """Ollama messages → template dicts; tool results keep the tool's name."""
    out = []
    for m in body.messages:
        msg = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        out.append(msg)
    return tools.template_messages(out)


def _model_details(state: ServerState) -> dict:
    target = state.session.target
    n_params = state.n_params
    return {
        "parent_model": "",
        "format": "mlx",
        "family": target.model_type,
        "families": [target.model_type],
        "parameter_size": _count(n_params),
        "quantization_level": state.quantization,
    }


def _count(n: int) -> str:
    """Ollama's parameter_size spelling: 8.0B, 135M, 340K."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _dir_size(path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*") if f.is_file()) if p.is_dir() else 0


def _model_entry(state: ServerState) -> dict:
    target_path = Path(state.session.spec.target)
    when = target_path.stat().st_mtime if target_path.exists() else time.time()
    name = state.model_name if ":" in state.model_name else f"{state.model_name}:latest"
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(when, UTC).isoformat().replace("+00:00", "Z"),
        "size": _dir_size(target_path),
        "digest": hashlib.sha256(str(target_path).encode()).hexdigest(),
        "details": _model_details(state),
    }


@router.api_route("/tags", methods=["GET", "HEAD"], summary="The loaded model (Ollama)")
async def tags(state: StateDep):
    return {"models": [_model_entry(state)]}


@router.post("/show", summary="Model details (Ollama)")
async def show(body: OllamaShowRequest, state: StateDep):
    dispatch.check_model(state, body.model or body.name)
    target = state.session.target
    arch = target.model_type
    return {
        "modelfile": "",
        "parameters": "",
        "template": getattr(target.tokenizer, "chat_template", None) or "",
        "details": _model_details(state),
        "model_info": {"general.architecture": arch, "general.parameter_count": state.n_params,
                       f"{arch}.context_length": state.context_window},
        "capabilities": ["completion"],
        "modified_at": _model_entry(state)["modified_at"],
    }


@router.api_route("/ps", methods=["GET", "HEAD"], summary="Loaded models (Ollama)")
async def ps(state: StateDep):
    import mlx.core as mx

    entry = _model_entry(state)
    on_gpu = mx.default_device() == mx.gpu
    # The one model stays loaded for the server's lifetime, whatever keep_alive asked.
    return {"models": [{**entry, "expires_at": NEVER, "size_vram": entry["size"] if on_gpu else 0,
                        "context_length": state.context_window}]}


@router.api_route("/version", methods=["GET", "HEAD"], summary="Server version (Ollama)")
async def version():
    return {"version": __version__}
