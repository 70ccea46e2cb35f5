"""Run the app under uvicorn until Ctrl-C / SIGTERM, then drain and shut down gracefully.

On the first signal the server drains: it keeps listening, but every new request (but
/health, which reports "shutting down") gets 503 with Retry-After, while in-flight requests
get `shutdown_timeout` seconds to finish. Whatever still runs then is failed with a 503
error event, so each open stream ends with an error chunk and `[DONE]` (Ollama: an error
line), never mid-air. Then uvicorn closes, the worker thread is joined and the process
returns normally. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

from .app import create_app
from .config import ServerConfig
from .protocol import fit_connection_limit, install_log_limits, protocol_class

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server that drains the worker on the first signal and exits on the second."""

    def __init__(self, config: uvicorn.Config, worker, drain_timeout: float,
                 on_ready: Callable[[str], None] | None):
        super().__init__(config)
        self._worker, self._drain_timeout, self._on_ready = worker, drain_timeout, on_ready
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is None:
            self._captured_signals.append(sig)  # uvicorn re-raises these after its shutdown
            self._worker.stop_accepting()
            self._drainer = threading.Thread(target=self._drain, name="dflash2-drain", daemon=True)
            self._drainer.start()
            log.info("draining: new requests get 503; %.0f s for in-flight ones", self._drain_timeout)
            return
        self._captured_signals.append(sig)
        self.should_exit = self.force_exit = True

    def _drain(self) -> None:
        if not self._worker.wait_idle(self._drain_timeout):
            log.warning("shutdown timeout reached: ending the requests still running with a 503 error")
            self._worker.close(timeout=5.0)
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


def serve(session, config: ServerConfig | None = None, on_ready: Callable[[str], None] | None = None,
          aliases=()) -> None:
    """Serve `session` until interrupted.

    Args:
        session: an open `Session`.
        config: a `ServerConfig` (default: 127.0.0.1:8000, no API key).
        on_ready: called with the base URL (real port included) once the socket listens.
        aliases: more names the request `model` field may use for the pair.
    """
    config = config or ServerConfig()
    app = create_app(session, config, aliases)
    worker = app.state.dflash.worker
    install_log_limits()
    http = protocol_class(fit_connection_limit(config.max_connections), config.read_timeout)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, lifespan="on", http=http,
        timeout_graceful_shutdown=config.shutdown_timeout + 2.0, timeout_keep_alive=5,
    )
    server = _Server(uv_config, worker, config.shutdown_timeout, on_ready=on_ready)
    # uvicorn re-raises the signal after its graceful shutdown; a no-op SIGTERM handler makes
    # that a normal return (exit 0), and Ctrl-C's KeyboardInterrupt is caught below.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.close()  # idempotent; joins the generation thread if the lifespan could not
    log.info("server stopped")
