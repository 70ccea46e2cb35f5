"""Every failure becomes one JSON error in the shape of its route's API.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Ollama (/api/): `{"error": "message"}`;
Anthropic (/v1/messages): `{"type": "error", "error": {"type", "message"}}`.
Schema violations and malformed JSON are 400 (OpenAI's status, not FastAPI's 422), a
`DFlashError` is 400, unknown routes 404, a full queue 429, shutdown 503, bugs 500 (logged).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DFlashError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """An error answered to the client as-is (status, message, OpenAI type/code/param)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, err: APIError) -> dict:
    if path.startswith("/api/"):
        return {"error": err.message}
    if is_anthropic(path):
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "null"})


def _field_path(loc) -> str:
    """The user's field path of a pydantic error location, cut where pydantic's own union
    members and validators (`list[int]`, `TextPart`, `function-after[...]`) begin."""
    parts = []
    for item in loc:
        if item == "body":
            continue
        text = str(item)
        internal = isinstance(item, str) and (any(c in text for c in "[](),-") or text in _TYPE_NAMES
                                              or text[:1].isupper())
        if internal:
            break
        parts.append(text)
    return ".".join(parts)


def _reason(message: str) -> str:
    return message.removeprefix("Value error, ")


def validation_message(errors) -> tuple[str, str | None]:
    """One line naming each bad field and its value, and the first field's name.

    A value matching none of a union's forms gives one entry per form; they are merged into
    one clause per field ("a valid string or a valid integer").
    """
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "invalid JSON")
            return f"malformed JSON body: {detail}", None
    fields: dict[str, list] = {}
    for e in errors:
        fields.setdefault(_field_path(e.get("loc", ())), []).append(e)
    parts = []
    for field, errs in list(fields.items())[:5]:
        reasons = list(dict.fromkeys(_reason(e.get("msg", "invalid")) for e in errs))
        merged = reasons[0] + "".join(f" or {r.removeprefix('Input should be ')}" for r in reasons[1:3])
        first = errs[0]
        shown = "input" in first and first.get("type") != "missing" and ", got " not in merged
        got = f" (got {_short(first['input'])})" if shown else ""
        parts.append(f"{field or 'body'}: {merged}{got}")
    more = f" (+{len(fields) - 5} more)" if len(fields) > 5 else ""
    return "; ".join(parts) + more, next(iter(fields), None) or None


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the JSON shape of its route's API."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(request.url.path, err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        message, param = validation_message(err.errors())
        if any(isinstance(e.get("input"), bytes) and tuple(e.get("loc", ())) == ("body",) for e in err.errors()):
            # The body was not parsed: JSON is read only with a JSON content type (FastAPI's CSRF guard).
            kind = request.headers.get("content-type") or "none"
            message = f"the request body must be JSON sent with 'Content-Type: application/json' (got {kind})"
        return error_response(request.url.path, APIError(400, message, "invalid_value", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"unknown route {request.method} {request.url.path}"
        elif err.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return error_response(request.url.path, APIError(err.status_code, message, headers=err.headers))

    @app.exception_handler(DFlashError)
    async def _dflash(request: Request, err: DFlashError):
        return error_response(request.url.path, APIError(400, str(err), "invalid_value"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, APIError(500, f"internal error: {type(err).__name__}"))
