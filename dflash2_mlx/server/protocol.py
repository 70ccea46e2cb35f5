"""Connection hygiene under uvicorn: a bounded number of sockets and a header read deadline.

uvicorn (h11) keeps a connection that never finishes its request headers open forever, and
accepts sockets until the process runs out of file descriptors. `GuardedH11Protocol`:

- gives every request `read_timeout` seconds from its first byte (or from the connection's
  start) to deliver complete headers, else answers 408 and closes;
- admits at most `max_connections` sockets: a new one first evicts the oldest connection that
  is not inside a request (idle keep-alive, or headers still incomplete), so slow or idle
  clients cannot lock out /health; when every slot holds a live request, the newcomer gets a
  canned 503 and is closed before any parsing.

The request body's own deadline and size limit are enforced by the app's `Guard`.
"""

from __future__ import annotations

import logging
import resource
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dflash2.server")

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_FD_RESERVE = 64  # descriptors kept free for model files, logs and the listening socket


class RateLimitedLog(logging.Filter):
    """Lets each message template through at most once per `every` seconds; counts the rest."""

    def __init__(self, every: float = 10.0):
        super().__init__()
        self.every, self._last, self._dropped = every, {}, {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.every:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {self.every:.0f} s)"
        return True


def install_log_limits(every: float = 10.0) -> None:
    """Rate-limit the loggers a connection flood writes to (asyncio's accept errors, uvicorn's)."""
    limiter = RateLimitedLog(every)
    for name in ("asyncio", "uvicorn.error", "dflash2.server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(limiter)


def fit_connection_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit as far as needed (and allowed); return the usable limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        soft = new_soft
    usable = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - _FD_RESERVE)
    if usable < max_connections:
        log.warning("--max-connections %d lowered to %d: the process may open only %d files",
                    max_connections, usable, soft)
    return max(usable, 1)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a header read deadline."""

    max_connections = 256
    read_timeout = 15.0

    def connection_made(self, transport) -> None:
        self.opened_at = time.monotonic()
        self._header_deadline = None
        if len(self.connections) >= self.max_connections and not self._evict_one():
            body = b'{"error":{"message":"too many open connections; retry shortly","type":"server_error",' \
                   b'"param":null,"code":"server_busy"}}'
            transport.write(_REFUSED % (len(body), body))
            transport.close()
            log.warning("refused a connection: all %d connection slots hold live requests", self.max_connections)
            self.transport = transport
            self.refused = True
            return
        self.refused = False
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        if self.refused:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_deadline()  # bytes of a request whose headers are not complete yet
        else:
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_header_deadline()  # between requests, uvicorn's keep-alive timeout applies

    # -- deadlines and eviction ------------------------------------------------------------

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.read_timeout, self._headers_timed_out)

    def _disarm_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.write(_TIMED_OUT)
            self.transport.close()

    def in_request(self) -> bool:
        """Whether a request's headers arrived and its response is not finished."""
        return self.cycle is not None and not self.cycle.response_complete

    def _evict_one(self) -> bool:
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and not c.in_request()
                and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened_at)
        oldest._disarm_header_deadline()
        oldest.transport.close()
        self.connections.discard(oldest)
        log.warning("closed an idle connection to admit a new one (--max-connections %d)", self.max_connections)
        return True


def protocol_class(max_connections: int, read_timeout: float) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` subclass bound to these limits (uvicorn takes a class)."""
    return type("BoundGuardedH11Protocol", (GuardedH11Protocol,),
                {"max_connections": max_connections, "read_timeout": read_timeout})
