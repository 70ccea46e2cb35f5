"""`dflash2 serve`: a local OpenAI- and Ollama-compatible server over one model pair."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from typing import Annotated, Optional

import typer

from .common import BlockSizeOpt, DraftBitsOpt, DrafterOpt, JsonOpt, ModelArg, user_errors

EXAMPLES = """
Examples:

  dflash2 serve                                   # the built-in demo pair on 127.0.0.1:8000

  dflash2 serve Qwen3.8-27B --port 8080 --api-key secret

  dflash2 serve ./my-model --drafter ./my-drafter --max-tokens-cap 8192 --json

  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages":[{"role":"user","content":"Hi"}]}'

  curl localhost:8000/api/generate -H 'Content-Type: application/json' -d '{"prompt": "Hi"}'

  Routes: POST /v1/chat/completions, /v1/completions, /api/chat, /api/generate, /api/show;
  GET /v1/models, /api/tags, /api/version, /health (no auth), /metrics (Prometheus).
"""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a model pair over the OpenAI and Ollama HTTP APIs." + EXAMPLES)(serve)


@user_errors
def serve(
    model: ModelArg = None,
    drafter: DrafterOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind. Anything but loopback exposes the "
                                                      "model to your network: set --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port (0 picks a free one).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DFLASH2_API_KEY",
                                                   help="Require 'Authorization: Bearer KEY' on every route "
                                                        "but /health.")] = None,
    max_concurrency: Annotated[int, typer.Option("--max-concurrency", min=1,
                                                 help="Requests admitted at once (one generates, the rest wait "
                                                      "in FIFO order); more get 429 + Retry-After.")] = 64,
    max_tokens_cap: Annotated[int, typer.Option("--max-tokens-cap", min=1,
                                                help="Largest max_tokens a request may ask for.")] = 4096,
    max_prompt_tokens: Annotated[Optional[int], typer.Option("--max-prompt-tokens", min=1,
                                                             help="Longest prompt in tokens. Default: the "
                                                                  "model's context length.")] = None,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Temperature for requests that set none "
                                                               "(0 = greedy).")] = 0.0,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", min=0.0,
                                                    help="Seconds in-flight requests get to finish on "
                                                         "Ctrl-C / SIGTERM.")] = 10.0,
    block_size: BlockSizeOpt = None,
    draft_bits: DraftBitsOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
    json_out: JsonOpt = False,
) -> None:
    from ..server import ServerConfig
    from ..server import serve as run_server
    from ..server.dispatch import served_name
    from ..session import Session

    config = ServerConfig(host=host, port=port, api_key=api_key, max_concurrency=max_concurrency,
                          max_tokens_cap=max_tokens_cap, max_prompt_tokens=max_prompt_tokens,
                          default_temperature=temp, shutdown_timeout=shutdown_timeout, log_level=log_level)
    session = Session.open(model, drafter=drafter, draft_bits=draft_bits, block_size=block_size,
                           progress=not json_out)
    if host not in LOOPBACK and api_key is None:
        typer.echo(f"warning: listening on {host} without --api-key; anyone who can reach it can use it", err=True)

    def ready(url: str) -> None:
        if json_out:
            info = {"event": "listening", "url": url, "model": served_name(session),
                    "target": str(session.spec.target),
                    "drafter": None if session.drafter is None else str(session.spec.drafter),
                    "openai_base_url": f"{url}/v1", "ollama_base_url": url, "auth": api_key is not None}
            sys.stdout.write(json.dumps(info) + "\n")
            sys.stdout.flush()
            return
        typer.echo(f"Serving {session.describe()} as model {served_name(session)!r}", err=True)
        typer.echo(f"  OpenAI base URL: {url}/v1   Ollama: {url}   metrics: {url}/metrics", err=True)
        for note in session.notes:
            typer.echo(f"  note: {note}", err=True)
        typer.echo("  Ctrl-C to stop.", err=True)

    faulthandler.enable()  # a native crash prints every thread's Python stack to stderr
    run_server(session, config, on_ready=ready)
    # Every request is finished and the worker joined. Skip interpreter teardown: MLX's native
    # runtime can abort (SIGABRT) there on a race with idle library threads, seen once in CI.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
