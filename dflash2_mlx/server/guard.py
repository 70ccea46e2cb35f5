"""ASGI middleware in front of every route: Host check, drain, auth, body limits, response counts.

In order, a request is refused when its Host header is not a served name (DNS rebinding: a
page on evil.example resolving to 127.0.0.1 must not reach the API) → 403; it changes state
(not GET / HEAD / OPTIONS) and comes from a web page whose Origin is neither loopback, a served
host nor a `--cors-origin` (a "simple" cross-origin POST needs no preflight, so any page the
user visits could otherwise start generations here) → 403; the server is draining for
shutdown → 503 (/health answers that itself); the bearer key is wrong → 401.
A body is then read here, whole, before any route sees it: past `max_body_bytes` → 413
however it is sent (Content-Length or chunked), not complete within `read_timeout` → 408.
The route gets the buffered body, labelled as JSON whatever the client's Content-Type
(Ollama's curl examples and litellm send JSON without one, and the reference servers accept it).
"""

from __future__ import annotations

import asyncio
import secrets
import time

from .dispatch import ServerState
from .errors import APIError, error_response

PUBLIC_PATHS = frozenset({"/health"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(value: bytes) -> str:
    """The name part of a Host header: 'localhost:8000' → 'localhost', '[::1]:80' → '::1'."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


def _as_json(scope) -> dict:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _replay(body: bytes, receive):
    """An ASGI receive that yields the buffered body once, then the client's next messages."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class Guard:
    """The checks above, plus one count per response status for /metrics."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None
        self.hosts = state.config.host_names()
        self.any_host = "*" in self.hosts
        self.origins = {o.lower().rstrip("/") for o in state.config.cors_origins}

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
            if refusal is None and scope["method"] in BODY_METHODS:
                body, refusal = await self._read_body(receive)
                if body is None and refusal is None:
                    return  # the client left before sending its body
                if refusal is None:
                    receive = _replay(body, receive)
                    headers = dict(scope["headers"])
                    if not _is_json(headers.get(b"content-type", b"")):
                        scope = _as_json(scope)
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
        host = headers.get(b"host")
        if host is not None and not self.any_host and host_name(host) not in self.hosts:
            name = host.decode("latin-1")
            return APIError(403, f"Host {name!r} is not served here (a DNS-rebinding guard); start the server "
                                 f"with --allowed-host {host_name(host)} to allow it", "host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and scope["method"] not in SAFE_METHODS and not self._origin_allowed(origin):
            name = origin.decode("latin-1")
            return APIError(403, f"requests from the web page {name!r} are refused (Origin not allowed); start the "
                                 f"server with --cors-origin {name} to allow that page", "origin_not_allowed")
        if not self.state.worker.accepting and scope["path"] not in PUBLIC_PATHS:
            return APIError(503, "server is shutting down", "server_shutting_down", headers={"Retry-After": "5"})
        if self.expected is not None and scope["path"] not in PUBLIC_PATHS:
            given = headers.get(b"authorization") or (b"Bearer " + headers[b"x-api-key"]
                                                       if b"x-api-key" in headers else b"")
            if not secrets.compare_digest(given, self.expected):
                why = "missing Authorization header" if not given else "invalid API key"
                return APIError(401, f"{why}; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                                "invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        size = headers.get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.state.config.max_body_bytes):
            return self._too_large(size.decode(errors="replace"))
        return None

    def _origin_allowed(self, origin: bytes) -> bool:
        """Loopback pages, pages of a served host name, and the --cors-origin list ("*": any)."""
        text = origin.decode("latin-1").strip().lower().rstrip("/")
        if "*" in self.origins or text in self.origins:
            return True
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in ("http", "https"):
            return False  # "null" (file://, sandboxed frames), extensions' own schemes
        host = host_name(rest.encode("latin-1"))
        return host in LOOPBACK or (not self.any_host and host in self.hosts)

    def _too_large(self, size: str) -> APIError:
        limit = self.state.config.max_body_bytes
        return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes", "request_too_large",
                        headers={"Connection": "close"})

    async def _read_body(self, receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or the refusal: over the size limit (413) or too slow (408)."""
        limit, timeout = self.state.config.max_body_bytes, self.state.config.read_timeout
        deadline = time.monotonic() + timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 1e-3))
            except TimeoutError:
                return None, APIError(408, f"the request body did not arrive within {timeout:g} s (--read-timeout)",
                                      "request_timeout", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, self._too_large(f"more than {limit}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None
