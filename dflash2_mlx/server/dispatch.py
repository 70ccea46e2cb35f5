"""From a validated request to a queued job and back, shared by the OpenAI and Ollama routes.

The steps every generation route takes: check the requested model names the loaded pair
(never a path: the server loads nothing on request), encode the prompt off the event loop,
bound prompt and output lengths, build `SamplingParams`, submit to the worker, then stream
or collect the job's events. Whatever ends a request early (client gone, shutdown, error)
cancels its job.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import Depends, Request

from .._version import __version__
from ..core.interfaces import Constraint
from ..core.sampling import SamplingParams
from ..errors import ConfigError, DFlashError
from . import reasoning
from .cache_pool import PromptCachePool
from .config import DEFAULT_MAX_PROMPT_TOKENS, ServerConfig
from .errors import APIError
from .metrics import Metrics
from .response_store import ResponseStore
from .worker import GenerationWorker, Job, JobFailed, QueueFull, ServerClosing


@dataclass
class ServerState:
    """What every route needs: the session, the limits, the worker and the counters."""

    session: object
    config: ServerConfig
    worker: GenerationWorker
    metrics: Metrics
    model_name: str
    aliases: frozenset[str]
    max_prompt_tokens: int
    context_window: int = DEFAULT_MAX_PROMPT_TOKENS
    n_params: int = 0
    quantization: str = "none"
    created: int = field(default_factory=lambda: int(time.time()))
    encode_lock: threading.Lock = field(default_factory=threading.Lock)
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's recent responses


def served_name(session) -> str:
    """The name clients use for the loaded pair: the resolved name, or a directory's basename."""
    return public_name(getattr(session.spec, "name", "") or session.spec.target)


def public_name(name) -> str:
    """A model or drafter name fit for unauthenticated routes (/health, /metrics): a path's basename."""
    text = str(name)
    return Path(text).name if looks_like_path(text) else text


def looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.endswith(".gguf")
            or (len(name) > 1 and name[1] == ":") or name in (".", ".."))


def context_length(session) -> int:
    """The target's max_position_embeddings (top level or text_config), else 32768."""
    args = getattr(session.target, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    if n is None:
        text = getattr(args, "text_config", None)
        n = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else DEFAULT_MAX_PROMPT_TOKENS


def model_facts(model) -> tuple[int, str]:
    """(parameter count, quantization level like "Q4") from shapes alone; evaluates nothing."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")})
    n_params = 0
    for name, p in tree_flatten(model.parameters()):
        if bits and name.endswith((".scales", ".biases")):  # quantization metadata, not parameters
            continue
        n_params += p.size * 32 // bits[0] if bits and p.dtype == mx.uint32 else p.size
    return n_params, (f"Q{bits[0]}" if bits else "none")


def kv_budget(session, config: ServerConfig):
    """The K/V budget that bounds the batch by memory (None when requests run one at a time)."""
    if config.max_batch <= 1:
        return None
    from .capacity import KVBudget, auto_budget, measure_kv_cost

    budget = config.batch_memory or auto_budget(session, config.prompt_cache_bytes)
    budget = KVBudget(budget, measure_kv_cost(session))
    session.notes.append(f"batch: up to {config.max_batch} requests, {budget.describe()}")
    return budget


def make_state(session, config: ServerConfig, extra_aliases=()) -> ServerState:
    name = served_name(session)
    n_params, quantization = model_facts(session.target.model)
    drafter = getattr(session.spec, "drafter", None) if session.drafter is not None else None
    pool = PromptCachePool(session.prompt_cache, config.prompt_cache_bytes)
    metrics = Metrics({"model": name, "drafter": public_name(drafter) if drafter else "none", "version": __version__},
                      prompt_caches=pool, request_log=config.request_log)
    worker = GenerationWorker(session, config.max_concurrency, metrics, config.prefill_chunk,
                              pool if pool.enabled else None, config.max_batch, kv_budget(session, config))
    return ServerState(
        session=session, config=config, worker=worker,
        metrics=metrics, model_name=name, aliases=frozenset({name, *extra_aliases}),
        max_prompt_tokens=min(config.max_prompt_tokens or context_length(session), context_length(session)),
        context_window=context_length(session),
        n_params=n_params, quantization=quantization,
    )


def speculation_info(state: ServerState) -> dict:
    """Which drafter is active, the width policy, and why speculation is off when it is."""
    session = state.session
    if session.drafter is None:
        return {"drafter": None, "width_policy": "plain", "active": False,
                "fallback_reason": "no drafter is loaded: every request decodes plainly"}
    info = {"drafter": public_name(session.spec.drafter),
            "width_policy": "auto" if session.adaptive else f"fixed {session.width}",
            "active": True, "fallback_reason": None, "tokens_per_cycle": round(state.metrics.tokens_per_cycle(), 4)}
    policy = session.policy
    if policy is not None:
        info["current_width"] = policy.current
        if not policy.can_ever_win(policy.costs.max_width):
            info.update(active=False, fallback_reason="the calibration says no width beats plain decoding on this "
                                                      "machine: decoding plainly, probing now and then")
        elif policy.current == 1:
            info.update(active=False, fallback_reason="the measured acceptance does not pay right now: decoding "
                                                      "plainly, probing now and then")
    return info


def get_state(request: Request) -> ServerState:
    return request.app.state.dflash


StateDep = Annotated[ServerState, Depends(get_state)]


# -- checks ----------------------------------------------------------------------------------


def check_model(state: ServerState, requested: str | None) -> str:
    """The served name if `requested` names the loaded pair (or is empty); else a 4xx.

    Names match without case and with an optional Ollama `:latest` tag. The server never
    loads anything on request, so a path or another alias is refused, not resolved.
    """
    if not requested or not requested.strip():
        return state.model_name
    name = requested.strip()
    base = name[: -len(":latest")] if name.lower().endswith(":latest") else name
    known = {a.lower() for a in state.aliases}
    if name.lower() in known or base.lower() in known:
        return state.model_name
    if looks_like_path(name):
        raise APIError(400, f"model {name!r} looks like a filesystem path; this server loads nothing on request "
                            f"and serves only {state.model_name!r}", "invalid_model", "model")
    hint = f"start `dflash2 serve {base}` to serve it" if _registry_knows(base) else "see GET /v1/models"
    raise APIError(404, f"model {name!r} is not loaded; this server serves {state.model_name!r} ({hint})",
                   "model_not_found", "model")


def _registry_knows(name: str) -> bool:
    try:
        from ..registry import load_registry

        return load_registry().find(name) is not None
    except (DFlashError, OSError):  # a missing or broken registry only loses the hint
        return False


def check_unsupported(body) -> None:
    message = body.unsupported()
    if message:
        raise APIError(400, message, "unsupported_parameter")


def max_tokens(state: ServerState, *requested: int | None, name: str = "max_tokens") -> int:
    """The first limit given (or the server default), refused above --max-tokens-cap."""
    value = next((v for v in requested if v is not None), None)
    if value is None:
        return state.config.max_tokens_default
    cap = state.config.max_tokens_cap
    if value > cap:
        raise APIError(400, f"{name} {value} exceeds this server's cap of {cap} (--max-tokens-cap)",
                       "invalid_value", name)
    return value


def fit_context(state: ServerState, n_prompt: int, n_max: int, explicit: bool, name: str = "max_tokens",
                window: int | None = None) -> int:
    """The output budget that fits the context window (prompt + output <= window).

    As OpenAI and vLLM do: an explicit limit that cannot fit is refused with
    `context_length_exceeded`; the server's default limit is clamped to the room left.
    """
    window = window or state.context_window
    room = window - n_prompt
    if n_max <= room:
        return n_max
    if explicit or room < 1:
        asked = f"{name} asks for {n_max}" if explicit else "no room is left for output"
        raise APIError(400, f"the context window is {window} tokens; the prompt has {n_prompt} and {asked} "
                            f"({n_prompt} + {n_max} > {window}); shorten the prompt or lower {name}",
                       "context_length_exceeded", name)
    return room


_RESERVED_TEMPLATE_KEYS = frozenset({"tokenize", "add_generation_prompt", "conversation", "messages", "return_dict",
                                     "return_tensors", "tools", "documents", "chat_template",
                                     "continue_final_message", "padding", "truncation", "max_length"})


def template_kwargs(state: ServerState, think: bool | None = None, reasoning_effort: str | None = None,
                    extra: dict | None = None, think_field: str = "think") -> dict:
    """Chat-template variables for a request; a mode the model's template lacks → 400 naming it."""
    template = getattr(state.session.target.tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template))
    kwargs = dict(extra or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KEYS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}; the server sets these itself",
                       "invalid_value", "chat_template_kwargs")
    if think is not None:
        kwargs["enable_thinking"] = think
    if kwargs.get("enable_thinking") is True and "enable_thinking" not in template:
        raise APIError(400, f"{think_field}: {state.model_name!r} has no thinking mode (its chat template does not "
                            "use enable_thinking)", "unsupported_parameter", think_field)
    if reasoning_effort is not None:
        if "reasoning_effort" not in template:
            raise APIError(400, f"reasoning_effort: {state.model_name!r} has no reasoning-effort setting (its chat "
                                "template does not use reasoning_effort)", "unsupported_parameter",
                           "reasoning_effort")
        kwargs["reasoning_effort"] = reasoning_effort
    return kwargs


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def sampling(state: ServerState, temperature=None, seed=None, **kwargs) -> SamplingParams:
    """SamplingParams from request fields; None means the default. Bad values → 400."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    temp = state.config.default_temperature if temperature is None else temperature
    try:
        return SamplingParams(temperature=temp, seed=seed, **given)
    except ConfigError as e:
        raise APIError(400, str(e), "invalid_value") from None


async def encode(state: ServerState, prompt, raw: bool, system: str | None = None,
                 template: dict | None = None) -> list[int]:
    """Token ids via `Session.encode`, off the event loop; template errors → 400."""
    from jinja2 import TemplateError

    def work():
        with state.encode_lock:  # fast tokenizers are not safe to share across threads
            return state.session.encode(prompt, system=system, raw=raw, template=template)

    try:
        ids = await anyio.to_thread.run_sync(work)
    except (ValueError, TypeError, KeyError, IndexError, TemplateError) as e:
        raise APIError(400, f"cannot build the prompt: {e}", "invalid_prompt") from None
    return [int(t) for t in ids]


MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 24


def _depth(value, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Nesting depth of dicts and lists, counted without recursion and only up to `limit` + 1
    (a schema nested thousands of levels must be a 400, not a RecursionError)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level + 1)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


async def json_constraint(state: ServerState, schema: dict | None, param: str):
    """A GrammarConstraint for JSON matching `schema` (None: any object); a bad, too large or too
    deep schema → 400 naming `param`. Built off the event loop (the first one scans the vocab)."""
    from ..core.constraint import json_schema_grammar

    if schema is not None:
        if not isinstance(schema, dict):
            raise APIError(400, f"{param} must be a JSON schema object, got {type(schema).__name__}", "invalid_value",
                           param)
        size = len(json.dumps(schema))
        if size > MAX_SCHEMA_CHARS:
            raise APIError(400, f"{param} is {size} characters; at most {MAX_SCHEMA_CHARS}", "invalid_value", param)
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise APIError(400, f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", "invalid_value", param)
    return await grammar_constraint(state, lambda: json_schema_grammar(schema), param, json_reply=True)


async def grammar_constraint(state: ServerState, make_grammar, param: str, json_reply: bool = False):
    """A GrammarConstraint for the grammar `make_grammar()` returns, built off the event loop;
    a grammar that does not compile → 400 naming `param`. A JSON reply's digit runs are capped
    (`JSON_DIGIT_CAP`), so an unbounded number always ends."""
    from ..core.constraint import JSON_DIGIT_CAP, GrammarConstraint

    target = state.session.target
    cap = JSON_DIGIT_CAP if json_reply else None

    def work():
        with state.encode_lock:
            return GrammarConstraint(target.tokenizer, target.info.vocab_size, target.eos_token_ids, make_grammar(),
                                     digit_cap=cap)

    try:
        return await anyio.to_thread.run_sync(work)
    except ConfigError as e:
        raise APIError(400, f"{param}: {e}", "invalid_value", param) from None


def check_prompt(state: ServerState, ids: list[int]) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", "invalid_prompt", "prompt")
    limit = state.max_prompt_tokens
    if len(ids) > limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limit} "
                            "(--max-prompt-tokens)", "context_length_exceeded", "prompt")
    vocab = state.session.target.info.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocab (size {vocab})", "invalid_value",
                       "prompt")


# -- running ----------------------------------------------------------------------------------


def submit(state: ServerState, ids: list[int], params: SamplingParams, n_max: int, stop: list[str],
           endpoint: str, top_logprobs: int | None = None, constraint: Constraint | None = None,
           thinking_budget: int | None = None) -> Job:
    """Queue a job; a full queue → 429 with Retry-After, shutdown → 503. A thinking model's
    reply thinks first: a grammar starts after its thinking span, which `thinking_budget` caps."""
    target = state.session.target
    constraint = reasoning.thinking_constraint(target.tokenizer, ids, target.info.vocab_size, thinking_budget,
                                               n_max, constraint)
    job = Job(ids, params, n_max, stop, asyncio.get_running_loop(), endpoint, top_logprobs, constraint)
    try:
        state.worker.submit(job)
    except QueueFull as e:
        retry = state.metrics.retry_after(e.depth)
        raise APIError(429, f"{e}; retry in {retry} s", "server_busy", headers={"Retry-After": str(retry)}) from None
    except ServerClosing as e:
        raise APIError(503, str(e), "server_shutting_down", headers={"Retry-After": "5"}) from None
    return job


def failure_error(e: JobFailed) -> APIError:
    return APIError(e.failure.status, e.failure.message, kind=e.failure.kind)


async def _cancel_on_disconnect(request: Request, state: ServerState, job: Job) -> None:
    # The body is already read, so the next message is the client's disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            state.worker.cancel(job)
            return


async def collect(request: Request, state: ServerState, job: Job) -> tuple[str, list[int]]:
    """Run a non-streaming job to its end: (text, token ids), log-probabilities (when asked
    for) gathered in `job.logprobs`. Cancels the job if the client leaves."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state, job))
    text, tokens = [], []
    job.logprobs = []
    try:
        async for event in job.events():
            text.append(event.text)
            tokens.extend(event.tokens)
            job.logprobs.extend(event.logprobs or ())
    except JobFailed as e:
        raise failure_error(e) from None
    finally:
        watcher.cancel()
        state.worker.cancel(job)
    return "".join(text), tokens


async def guarded(state: ServerState, job: Job, chunks):
    """Yield from a response stream; however it ends (disconnect, shutdown), cancel the job."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        state.worker.cancel(job)
