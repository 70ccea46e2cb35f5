"""Local OpenAI- and Ollama-compatible HTTP server over one open `Session`.

`create_app(session, config)` builds the FastAPI app; `serve(session, config)` runs it
under uvicorn with graceful shutdown. One generation worker thread owns all MLX work and
takes requests from a bounded FIFO queue.
"""

from .app import create_app
from .config import ServerConfig
from .run import serve

__all__ = ["ServerConfig", "create_app", "serve"]
