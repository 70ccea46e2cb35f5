"""Helpers for the server tests: a tiny pair on disk, a real `dflash2 serve` process, raw HTTP.

No tests live here; `test_server_*.py` import these helpers. The server is the real CLI in
a subprocess bound to 127.0.0.1 on a port the OS picks (`--port 0 --json` prints the URL).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from tiny import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dflash2_mlx"]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"

# A tiny chat template whose characters all exist in the tiny char vocab.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_pair(root: Path, byte_level: bool = False) -> tuple[Path, Path]:
    """The tiny llama target + DFlash 2 drafter, with a chat template added to the tokenizer
    (`byte_level`: the tokenizer grammar libraries can read)."""
    target_dir, drafter_dir = save_tiny_pair(root, byte_level=byte_level)
    config_path = target_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return target_dir, drafter_dir


def cli_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if os.path.exists(OPENBLAS) and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = OPENBLAS  # what the CLI would re-exec with; saves the re-exec
    return env


def start_cli(*args: str) -> subprocess.Popen:
    """`dflash2 ARGS` in a subprocess with piped text output (call `communicate`)."""
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=ROOT)


class ServerProcess:
    """`dflash2 serve` in a subprocess; `url` once it listens. Use as a context manager."""

    def __init__(self, target: Path, drafter: Path, *extra: str, log_path: Path, env: dict | None = None):
        self.args = ["serve", str(target), "--drafter", str(drafter), "--port", "0", "--json",
                     "--log-level", "warning", *extra]
        self.log_path = log_path
        self.env = {**cli_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 120) -> ServerProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*CLI, *self.args], stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()  # the --json banner, printed once the socket listens
        if not line or time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"server did not start: {self.logs()}")
        self.banner = json.loads(line)
        self.url = self.banner["url"]
        return self

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def connect(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(url: str, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
            timeout: float = 60) -> Reply:
    """One HTTP exchange; `body` is sent as JSON, `raw` as-is (for malformed input)."""
    conn = connect(url, timeout)
    try:
        hdrs = dict(headers or {})
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def open_stream(url: str, path: str, body: dict, headers: dict | None = None):
    """POST and return (connection, response) with the body unread, for line-by-line reading."""
    conn = connect(url)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def ndjson_lines(resp) -> list[dict]:
    """Parse an NDJSON body one line at a time, as Ollama clients do."""
    out = []
    while line := resp.readline():
        if line.strip():
            out.append(json.loads(line))
    return out


def sse_events(resp) -> list:
    """`data:` payloads of an SSE body, in order (JSON decoded; '[DONE]' kept as a string)."""
    out = []
    while line := resp.readline():
        text = line.decode().strip()
        if text.startswith("data:"):
            payload = text[len("data:"):].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metrics(url: str, headers: dict | None = None) -> dict:
    from dflash2_mlx.server.metrics import parse

    reply = request(url, "GET", "/metrics", headers=headers)
    assert reply.status == 200, reply.body
    return parse(reply.body.decode())


def wait_for(predicate, timeout: float = 30, interval: float = 0.05):
    """Poll until `predicate()` is truthy; return its value (or the last one on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
