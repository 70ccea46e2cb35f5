"""The FastAPI app over one open `Session`: routes, middleware, error shapes.

`create_app(session, config)` wires the OpenAI routes (`openai_api.py`), the Ollama routes
(`ollama.py`), /health, /metrics, / and /docs (Swagger UI served from the fastapi-offline
package, so it works without internet), behind `Guard` (Host, drain, auth, body limits) and,
when origins are configured, CORS. The generation worker starts and stops with the app's
lifespan; all MLX work happens on it.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline

from .._version import __version__
from ..errors import ConfigError
from . import anthropic, errors, ollama, openai_api, responses
from .config import ServerConfig
from .dispatch import StateDep, make_state, speculation_info
from .guard import Guard
from .schema import refused

STREAMING = {"/v1/chat/completions": "text/event-stream", "/v1/completions": "text/event-stream",
             "/v1/messages": "text/event-stream", "/v1/responses": "text/event-stream",
             "/api/chat": "application/x-ndjson", "/api/generate": "application/x-ndjson"}


def _error_responses() -> dict:
    schema = {"type": "object", "properties": {"error": {}}, "required": ["error"]}
    return {str(code): {"description": text, "content": {"application/json": {"schema": schema}}}
            for code, text in ((400, "Bad request"), (401, "Missing or invalid API key"),
                               (403, "Host not allowed"), (404, "Unknown model or route"),
                               (408, "Request body too slow"), (413, "Request body too large"),
                               (429, "Queue full; see Retry-After"), (503, "Shutting down"))}


def _bound_token_ids(schema, top: int) -> None:
    """Set the maximum of every integer (token id) inside a prompt schema to the vocab's top id."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = top
        for value in schema.values():
            _bound_token_ids(value, top)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, top)


def _template_modes(body: dict, template: str) -> None:
    """Chat-template modes this model lacks are refused: say so in the schema too."""
    props = body.get("properties", {})
    if "reasoning_effort" in props and "reasoning_effort" not in template:
        refused()(props["reasoning_effort"])
    if "think" in props and "enable_thinking" not in template:
        refused("false")(props["think"])


def _customize_openapi(app: FastAPI, model_name: str, max_tokens_cap: int, vocab_size: int,
                       template: str = "") -> None:
    """OpenAPI: our 400-shaped errors instead of FastAPI's 422, `model` limited to the loaded
    pair (the only name accepted, besides aliases and `:latest`), token limits at the cap and
    token ids inside the vocab."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values():
                    if path in STREAMING:  # "stream": true answers in another media type
                        op.get("responses", {}).get("200", {}).setdefault("content", {})[STREAMING[path]] = {}
                    op.get("responses", {}).pop("422", None)
                    op.setdefault("responses", {}).update(_error_responses())
                    for param in op.get("parameters", []):
                        if param.get("name") == "model":
                            param["schema"] = {"type": "string", "enum": [model_name], "title": "Model"}
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            for body in components.values():
                _template_modes(body, template)
                props = body.get("properties", {})
                if "model" in props:
                    props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                      "title": "Model"}
                if "prompt" in props and body.get("title") == "CompletionRequest":
                    _bound_token_ids(props["prompt"], vocab_size - 1)
                for name in ("max_tokens", "max_completion_tokens", "num_predict"):
                    for option in props.get(name, {}).get("anyOf", []):
                        if "maximum" in option:
                            option["maximum"] = max_tokens_cap
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def check_sharded(lockstep, config: ServerConfig) -> None:
    """A target sharded over processes serves one request at a time, every rank decoding it,
    without a prefix cache (the ranks' caches would have to agree on every entry)."""
    if lockstep is not None and (config.max_batch > 1 or config.prompt_cache_bytes > 0):
        raise ConfigError(f"a target sharded over {lockstep.size} ranks serves with --max-batch 1 and "
                          f"--prompt-cache-bytes 0, got {config.max_batch} and {config.prompt_cache_bytes}")


def create_app(session, config: ServerConfig | None = None, aliases=()) -> FastAPI:
    """A FastAPI app serving `session` (an open `Session`).

    Args:
        session: the loaded model pair; only the app's generation worker touches it.
        config: limits, auth and defaults (default `ServerConfig()`).
        aliases: more names the request `model` field may use for this pair.
    """
    config = config or ServerConfig()
    check_sharded(getattr(session, "lockstep", None), config)
    state = make_state(session, config, aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(state.worker.close)

    app = FastAPIOffline(title="dflash2", version=__version__, lifespan=lifespan, redoc_url=None,
                         description="DFlash 2 speculative decoding on MLX: OpenAI-, Ollama- and "
                                     "Anthropic-compatible API.")
    app.state.dflash = state
    errors.install(app)
    app.add_middleware(Guard, state=state)
    if config.cors_origins:  # outside Guard: preflights carry no credentials; errors get CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    app.include_router(openai_api.router)
    app.include_router(responses.router)
    app.include_router(ollama.router)
    app.include_router(anthropic.router)

    @app.api_route("/health", methods=["GET", "HEAD"], summary="Liveness and queue state (no auth)")
    async def health(state: StateDep):
        body = {"status": "ok" if state.worker.accepting else "shutting down", "model": state.model_name,
                "busy": state.worker.busy, "queue_depth": state.worker.depth,
                "speculation": speculation_info(state)}
        return JSONResponse(body, status_code=200 if state.worker.accepting else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"], summary="Prometheus metrics",
                   response_class=PlainTextResponse)
    async def metrics(state: StateDep):
        state.metrics.queue_depth(state.worker.depth)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], summary="Banner (Ollama clients probe it)",
                   response_class=PlainTextResponse)
    async def root(state: StateDep):
        return PlainTextResponse(f"dflash2 {__version__} is running: {state.model_name} "
                                 "(OpenAI API under /v1, Ollama API under /api)")

    template = getattr(session.target.tokenizer, "chat_template", None)
    _customize_openapi(app, state.model_name, config.max_tokens_cap, session.target.info.vocab_size,
                       template if isinstance(template, str) else "")
    return app
