"""`dflash2 serve`: a local OpenAI-, Anthropic- and Ollama-compatible server over one model pair."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from typing import Annotated, Optional

import typer

from ..server.config import DEFAULT_MAX_BATCH
from .common import (
    BlockSizeOpt,
    DraftBitsOpt,
    DrafterOpt,
    JsonOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    ModelArg,
    ShardOpt,
    user_errors,
    warn_slow_blas,
)

EXAMPLES = """
Examples:

  dflash2 serve                                   # the built-in demo pair on 127.0.0.1:8000

  dflash2 serve Qwen3.8-27B --port 8080 --api-key secret

  dflash2 serve ./my-model --drafter ./my-drafter --max-tokens-cap 8192 --json

  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages":[{"role":"user","content":"Hi"}]}'

  curl localhost:8000/api/generate -H 'Content-Type: application/json' -d '{"prompt": "Hi"}'

  dflash2 serve --cors-origin http://localhost:3000   # a browser front-end on another port

  Claude Code (Anthropic Messages API), against `dflash2 serve qwen2.5-coder-0.5b`:
    ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_API_KEY=local \
    ANTHROPIC_MODEL=qwen2.5-coder-0.5b ANTHROPIC_DEFAULT_HAIKU_MODEL=qwen2.5-coder-0.5b \
    ANTHROPIC_DEFAULT_SONNET_MODEL=qwen2.5-coder-0.5b ANTHROPIC_DEFAULT_OPUS_MODEL=qwen2.5-coder-0.5b \
    DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude

  Codex (OpenAI Responses API), in ~/.codex/config.toml:
    model = "qwen2.5-coder-0.5b"
    model_provider = "dflash2"
    web_search = "disabled"          # a hosted tool: it cannot run on a local server
    \\[model_providers.dflash2]
    name = "dflash2"
    base_url = "http://127.0.0.1:8000/v1"
    wire_api = "responses"

  Routes: POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI), /v1/messages,
  /v1/messages/count_tokens (Anthropic), /api/chat, /api/generate, /api/show (Ollama);
  GET /v1/models, /v1/models/{model}, /v1/responses/{id}, /api/tags, /api/ps, /api/version,
  /health (no auth), /metrics (Prometheus), /docs (API reference, works offline).
"""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a model pair over the OpenAI, Anthropic and Ollama HTTP APIs."
                + EXAMPLES)(serve)


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
                                                 help="Requests admitted at once: up to --max-batch decode "
                                                      "together in one speculative batch, the rest wait in "
                                                      "FIFO order; more get 429 + Retry-After.")] = 64,
    max_tokens_cap: Annotated[int, typer.Option("--max-tokens-cap", min=1,
                                                help="Largest max_tokens a request may ask for (the "
                                                     "OpenAI and Ollama routes refuse more; /v1/messages "
                                                     "clamps to it, as Claude Code asks for 32k-128k).")] = 4096,
    max_prompt_tokens: Annotated[Optional[int], typer.Option("--max-prompt-tokens", min=1,
                                                             help="Longest prompt in tokens. Default: the "
                                                                  "model's context length.")] = None,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Temperature for requests that set none "
                                                               "(0 = greedy).")] = 0.0,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", min=0.0,
                                                    help="Seconds in-flight requests get to finish on "
                                                         "Ctrl-C / SIGTERM.")] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", min=2,
                                                 help="Open sockets at most; a new one closes the oldest idle "
                                                      "one first, and gets 503 only when all hold live "
                                                      "requests.")] = 256,
    read_timeout: Annotated[float, typer.Option("--read-timeout", min=0.001,
                                                help="Seconds a client has to send its request headers, and "
                                                     "again its body (else 408 and the socket is closed).")] = 15.0,
    allowed_host: Annotated[Optional[list[str]], typer.Option("--allowed-host", metavar="NAME",
                                                              help="A Host header name to serve besides "
                                                                   "localhost/127.0.0.1/::1 and the --host "
                                                                   "address (DNS-rebinding guard); repeatable; "
                                                                   "'*' allows any.")] = None,
    cors_origin: Annotated[Optional[list[str]], typer.Option("--cors-origin", metavar="ORIGIN",
                                                             help="A browser origin allowed by CORS, e.g. "
                                                                  "http://localhost:3000; repeatable; '*' for "
                                                                  "any. Default: none.")] = None,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", min=16,
                                               help="Prompt tokens per prefill step; a client that leaves "
                                                    "is noticed between steps.")] = 512,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1,
                                           help="Requests decoding together in one speculative batch: "
                                                "one alone decodes as a single stream, several share one "
                                                "batched verify with per-row drafts (with --block-size "
                                                "auto the width follows the load, down to plain batched "
                                                "decoding); seeded requests run one at a time beside it "
                                                "(1: strictly one at a time). --batch-memory bounds "
                                                "them too.")] = DEFAULT_MAX_BATCH,
    batch_memory: Annotated[str, typer.Option("--batch-memory", metavar="SIZE",
                                              help="Memory for the K/V of the requests decoding together "
                                                   "(e.g. 8GiB): one whose prompt + max_tokens would not "
                                                   "fit waits for others to end. 'auto': half the device's "
                                                   "memory less the weights and --prompt-cache-bytes.")] = "auto",
    prompt_cache_bytes: Annotated[str, typer.Option("--prompt-cache-bytes", metavar="SIZE",
                                                    help="Memory for the prefix cache: the caches of recent "
                                                         "conversations, so a request resending a history "
                                                         "prefills only what is new (e.g. 4GiB, 512MB; 0 turns "
                                                         "it off).")] = "2GiB",
    request_log: Annotated[Optional[str], typer.Option("--request-log", metavar="FILE",
                                                       help="Append one JSON line per finished request: "
                                                            "endpoint, prompt and cached tokens, time to first "
                                                            "token, decode rate, tokens per cycle.")] = None,
    heartbeat: Annotated[float, typer.Option("--heartbeat", min=0.001, metavar="SECONDS",
                                             help="Seconds without output (a long prefill) after which a "
                                                  "stream sends a keep-alive its client counts: Responses "
                                                  "response.in_progress (Codex drops a stream silent for "
                                                  "300 s), Messages ping, an SSE comment elsewhere.")] = 10.0,
    block_size: BlockSizeOpt = None,
    draft_bits: DraftBitsOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    shard: ShardOpt = "tensor",
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
    json_out: JsonOpt = False,
) -> None:
    from ..paths import parse_bytes
    from ..server import ServerConfig
    from ..server import serve as run_server
    from ..server.dispatch import served_name
    from ..session import Session

    config = ServerConfig(host=host, port=port, api_key=api_key, max_concurrency=max_concurrency,
                          max_tokens_cap=max_tokens_cap, max_prompt_tokens=max_prompt_tokens,
                          default_temperature=temp, shutdown_timeout=shutdown_timeout, log_level=log_level,
                          max_connections=max_connections, read_timeout=read_timeout, prefill_chunk=prefill_chunk,
                          prompt_cache_bytes=parse_bytes(prompt_cache_bytes, "--prompt-cache-bytes"),
                          max_batch=max_batch, request_log=request_log, heartbeat=heartbeat,
                          batch_memory=None if batch_memory == "auto" else parse_bytes(batch_memory, "--batch-memory"),
                          allowed_hosts=tuple(allowed_host or ()), cors_origins=tuple(cors_origin or ()))
    if api_key is not None and os.environ.get("DFLASH2_API_KEY") != api_key:
        typer.echo("warning: --api-key on the command line is visible to every user of this machine (ps, "
                   "shell history); set DFLASH2_API_KEY instead", err=True)
    session = Session.open(model, drafter=drafter, draft_bits=draft_bits, block_size=block_size,
                           progress=not json_out, kv_bits=kv_bits, kv_group_size=kv_group_size, shard=shard)
    if session.lockstep is not None:
        config = _sharded(session, config)
        if config is None:  # a rank other than 0: it decoded what rank 0 served, until it stopped
            sys.stdout.flush()
            os._exit(0)
    warn_slow_blas()
    ready = session.prepare()  # calibrate before listening: never inside the first request
    if ready:
        session.notes.append(ready)
    if host not in LOOPBACK and api_key is None:
        typer.echo(f"warning: listening on {host} without --api-key; anyone who can reach it can use it", err=True)
    if host in ("0.0.0.0", "::") and "*" not in config.allowed_hosts:
        typer.echo("note: clients must send a Host header of a loopback name; add --allowed-host NAME for each "
                   "name or address others use to reach this machine", err=True)

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


def _sharded(session, config):
    """Under `mlx.launch`: rank 0 serves HTTP one request at a time without a prefix cache
    (every rank decodes each request in lockstep); the others follow until rank 0 stops.
    Returns rank 0's config, or None on the other ranks once they are done."""
    import dataclasses

    from ..core.distributed import follow_requests

    if not session.lockstep.leader:
        follow_requests(session)
        return None
    if config.max_batch > 1 or config.prompt_cache_bytes > 0:
        session.notes.append(f"sharded over {session.lockstep.size} ranks: one request at a time (--max-batch 1), "
                             "no prefix cache (--prompt-cache-bytes 0)")
    return dataclasses.replace(config, max_batch=1, prompt_cache_bytes=0)
