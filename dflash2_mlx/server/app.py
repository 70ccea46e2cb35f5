"""The FastAPI app over one open `Session`: routes, auth, body limit, error shapes.

`create_app(session, config)` wires the OpenAI routes (`openai_api.py`), the Ollama routes
(`ollama.py`), /health, /metrics and /. The generation worker starts and stops with the
app's lifespan; all MLX work happens on it.
"""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from .._version import __version__
from . import errors, ollama, openai_api
from .config import ServerConfig
from .dispatch import ServerState, StateDep, make_state
from .errors import APIError, error_response

PUBLIC_PATHS = frozenset({"/health"})


class Guard:
    """ASGI middleware: bearer auth (all routes but /health), body size limit, response counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            refusal = self._refuse(scope)
            if refusal is not None:
                return await error_response(path, refusal)(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        except Exception:
            status.append(500)  # answered by the outermost error middleware, after us
            raise
        finally:
            if status:
                self.state.metrics.response(path, status[0])

    def _refuse(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] not in PUBLIC_PATHS:
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                why = "missing Authorization header" if not given else "invalid API key"
                return APIError(401, f"{why}; send 'Authorization: Bearer <key>'", "invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        size = headers.get(b"content-length")
        limit = self.state.config.max_body_bytes
        if size is not None and (not size.isdigit() or int(size) > limit):
            return APIError(413, f"request body of {size.decode(errors='replace')} bytes exceeds the limit of "
                                 f"{limit} bytes", "request_too_large")
        return None


def _error_responses() -> dict:
    schema = {"type": "object", "properties": {"error": {}}, "required": ["error"]}
    return {str(code): {"description": text, "content": {"application/json": {"schema": schema}}}
            for code, text in ((400, "Bad request"), (401, "Missing or invalid API key"),
                               (404, "Unknown model or route"), (429, "Queue full; see Retry-After"),
                               (503, "Shutting down"))}


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


def _customize_openapi(app: FastAPI, model_name: str, max_tokens_cap: int, vocab_size: int) -> None:
    """OpenAPI: our 400-shaped errors instead of FastAPI's 422, `model` limited to the loaded
    pair (the only name accepted, besides aliases and `:latest`), token limits at the cap and
    token ids inside the vocab."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
                    op.setdefault("responses", {}).update(_error_responses())
                    for param in op.get("parameters", []):
                        if param.get("name") == "model":
                            param["schema"] = {"type": "string", "enum": [model_name], "title": "Model"}
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            for body in components.values():
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


def create_app(session, config: ServerConfig | None = None, aliases=()) -> FastAPI:
    """A FastAPI app serving `session` (an open `Session`).

    Args:
        session: the loaded model pair; only the app's generation worker touches it.
        config: limits, auth and defaults (default `ServerConfig()`).
        aliases: more names the request `model` field may use for this pair.
    """
    config = config or ServerConfig()
    state = make_state(session, config, aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(state.worker.close)

    app = FastAPI(title="dflash2", version=__version__, lifespan=lifespan,
                  description="DFlash 2 speculative decoding on MLX: OpenAI- and Ollama-compatible API.")
    app.state.dflash = state
    errors.install(app)
    app.add_middleware(Guard, state=state)
    app.include_router(openai_api.router)
    app.include_router(ollama.router)

    @app.get("/health", summary="Liveness and queue state (no auth)")
    async def health(state: StateDep):
        body = {"status": "ok" if state.worker.accepting else "shutting down", "model": state.model_name,
                "busy": state.worker.busy, "queue_depth": state.worker.depth}
        return JSONResponse(body, status_code=200 if state.worker.accepting else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics(state: StateDep):
        state.metrics.queue_depth(state.worker.depth)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], summary="Banner (Ollama clients probe it)",
                   response_class=PlainTextResponse)
    async def root(state: StateDep):
        return PlainTextResponse(f"dflash2 {__version__} is running: {state.model_name} "
                                 "(OpenAI API under /v1, Ollama API under /api)")

    _customize_openapi(app, state.model_name, config.max_tokens_cap, session.target.info.vocab_size)
    return app
