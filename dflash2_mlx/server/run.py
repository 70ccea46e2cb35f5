"""Run the app under uvicorn until Ctrl-C / SIGTERM, then shut down gracefully.

On the first signal the worker stops admitting jobs (new requests get 503), uvicorn stops
accepting connections and gives in-flight requests `shutdown_timeout` seconds to finish;
what is still running then is cancelled, the worker thread is joined and the process
returns normally. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import uvicorn

from .app import create_app
from .config import ServerConfig

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, told to stop admitting work the moment a signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], on_ready: Callable[[str], None] | None):
        super().__init__(config)
        self._on_exit, self._on_ready = on_exit, on_ready

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

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
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout + 2.0, timeout_keep_alive=5,
    )
    server = _Server(uv_config, on_exit=worker.stop_accepting, on_ready=on_ready)
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
