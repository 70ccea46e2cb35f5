"""Server settings: one frozen dataclass, validated once, shared by the app and the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_CONCURRENCY = 64
DEFAULT_MAX_TOKENS_CAP = 4096
DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_READ_TIMEOUT = 15.0
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_MAX_BATCH = 32  # rows, as mlx_lm.server's --decode-concurrency
DEFAULT_HEARTBEAT = 10.0  # seconds; Codex drops a stream after 300 s without an event
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerConfig:
    """How `dflash2 serve` listens, admits and bounds requests.

    Attributes:
        host, port: where to listen (default 127.0.0.1:8000; port 0 picks a free port).
        api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
        max_concurrency: most requests admitted at once: one generating, the rest waiting
            in FIFO order; one more is answered 429 with Retry-After.
        max_tokens_cap: the largest `max_tokens` a request may ask for.
        default_max_tokens: used when a request names no limit (capped by max_tokens_cap).
        max_prompt_tokens: the longest prompt, in tokens; None uses the target's context
            length (max_position_embeddings) or 32768.
        max_body_bytes: the largest request body.
        default_temperature: temperature when a request names none (0 = greedy).
        shutdown_timeout: seconds in-flight requests get to finish after Ctrl-C / SIGTERM
            before they are cancelled.
        log_level: uvicorn's log level.
        max_connections: most open sockets; a new one first closes the oldest idle one, and
            is refused with 503 only when every socket holds a live request.
        read_timeout: seconds a client has to send a request's headers, and again its body.
        allowed_hosts: Host header names accepted besides the loopback names (DNS-rebinding
            guard); "*" accepts any.
        cors_origins: browser origins allowed by CORS ("*" for any); none by default.
        prefill_chunk: prompt tokens per prefill step; a cancel is seen between steps.
        prompt_cache_bytes: bytes of reusable prompt caches kept between requests (the prefix
            cache; 0 turns it off).
        max_batch: most requests decoding together while another runs solo (1: one at a time).
        batch_memory: bytes for the K/V of the requests decoding together; a request whose prompt
            + max_tokens would not fit waits for others to end. None: half the device's memory
            less the weights and the prefix cache (`capacity.auto_budget`).
        heartbeat: seconds without output (a long prefill, a queue) after which a stream sends a
            keep-alive event its clients count as activity: Responses `response.in_progress`,
            Messages `ping`, an SSE comment on the other streams.
        request_log: a JSON-lines file that gets one line per finished request (endpoint, prompt
            and cached tokens, time to first token, decode rate, tokens per cycle), or None.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_prompt_tokens: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_temperature: float = 0.0
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    log_level: str = "info"
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_timeout: float = DEFAULT_READ_TIMEOUT
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    max_batch: int = DEFAULT_MAX_BATCH
    batch_memory: int | None = None
    request_log: str | None = None
    heartbeat: float = DEFAULT_HEARTBEAT

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_tokens_cap < 1:
            raise ConfigError(f"--max-tokens-cap must be >= 1, got {self.max_tokens_cap}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.default_temperature >= 0:
            raise ConfigError(f"--temp must be >= 0, got {self.default_temperature}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_connections < 2:
            raise ConfigError(f"--max-connections must be >= 2, got {self.max_connections}")
        if not self.read_timeout > 0:
            raise ConfigError(f"--read-timeout must be > 0 seconds, got {self.read_timeout}")
        if not self.heartbeat > 0:
            raise ConfigError(f"--heartbeat must be > 0 seconds, got {self.heartbeat}")
        if self.prefill_chunk < 16:
            raise ConfigError(f"prefill_chunk must be >= 16 tokens, got {self.prefill_chunk}")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.batch_memory is not None and self.batch_memory <= 0:
            raise ConfigError(f"--batch-memory must be > 0, got {self.batch_memory}")
        if self.prompt_cache_bytes < 0:
            raise ConfigError(f"--prompt-cache-bytes must be >= 0, got {self.prompt_cache_bytes}")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(f"--cors-origin must be '*' or start with http:// or https://, got {origin!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")

    @property
    def max_tokens_default(self) -> int:
        return min(self.default_max_tokens, self.max_tokens_cap)

    def host_names(self) -> frozenset[str]:
        """Host header names served: loopback, the bound address unless a wildcard, and --allowed-host."""
        bound = () if self.host in ("0.0.0.0", "::", "") else (self.host,)
        return frozenset(h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *bound, *self.allowed_hosts))
