"""Prefix caching through `dflash2 serve`: time to first token of a 6-turn chat over a ~2k-token history.

Three servers on the same target, side by side: `dflash2 serve` with its prefix cache (the
default), `dflash2 serve --prompt-cache-bytes 0`, and `mlx_lm.server` (the reference, with its
own LRU prompt cache), all with the fast BLAS the dflash2 CLI preloads. Each server holds its
own conversation (its own replies go back into its history); the turns are interleaved across
the servers, so each turn is measured on all three within seconds. The history is a system
prompt holding this project's README (held-out text: no drafter was trained on it) and the
turns. Greedy, chat template, streamed; TTFT is the time from sending the request to the first
content chunk, decode tok/s is (tokens - 1) / (last chunk - first chunk).

    .venv/bin/python docs/results/prefix-cache/measure.py --json docs/results/prefix-cache/result.json

Run on a quiet machine (nothing else on the cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
QUESTIONS = [
    "In two sentences: what does this project do?",
    "Which command runs the tests?",
    "What does the --block-size option control?",
    "Name the HTTP APIs the server speaks.",
    "How is speed measured, according to the document?",
    "Summarise our conversation so far in one sentence.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_env() -> dict:
    from dflash2_mlx import blas

    found = blas.find_fast_blas()
    return blas.reexec_env(found) if found is not None else dict(os.environ)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def start(name: str, args: list[str], env: dict, logs: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = open(logs / f"{name}.log", "w")
    proc = subprocess.Popen([*args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return url, proc


@contextlib.contextmanager
def servers_up(servers: dict, env: dict, logs: Path, timeout: float = 600):
    """Start every server of {name: command}; yield ({name: client}, {name: model id}); stop them."""
    procs, clients, models = {}, {}, {}
    try:
        for i, (name, cmd) in enumerate(servers.items()):
            url, procs[name] = start(f"{name.split()[0]}{i}", cmd, env, logs)
            clients[name] = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)
            # mlx_lm.server's /v1/models scans the HF cache, absent here; it serves --model as this name
            models[name] = "default_model" if name == "mlx_lm.server" else clients[name].models.list().data[0].id
        yield clients, models
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)


def turn(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage else len(text)
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"ttft_s": (first or time.perf_counter()) - t0, "text": "".join(text), "completion_tokens": n,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "decode_tps": (n - 1) / (last - first) if first and last and last > first and n > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default="/tmp/prefix-cache-logs")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)

    from dflash2_mlx import hub

    spec = hub.resolve(None, None)
    env = blas_env()
    dflash2 = [str(BIN / "dflash2"), "serve"]
    servers = {
        "dflash2 (prefix cache)": [*dflash2],
        "dflash2 (cache off)": [*dflash2, "--prompt-cache-bytes", "0"],
        "mlx_lm.server": [str(BIN / "python"), "-m", "mlx_lm.server", "--model", str(spec.target)],
    }
    with servers_up(servers, env, logs) as (clients, models):
        readme = (ROOT / "README.md").read_text()
        system = "Answer questions about this document briefly.\n\n" + readme[:9000]
        histories = {name: [{"role": "system", "content": system}] for name in servers}
        for name in servers:  # warm-up: a short unrelated request (no shared prefix with the chat)
            turn(clients[name], models[name], [{"role": "user", "content": "Say hi."}], 8)
        rows = {name: [] for name in servers}
        for i, question in enumerate(QUESTIONS):
            for name in servers:
                histories[name].append({"role": "user", "content": question})
                result = turn(clients[name], models[name], histories[name], args.max_tokens)
                histories[name].append({"role": "assistant", "content": result["text"]})
                rows[name].append(result)
                print(f"turn {i + 1} {name:24s} ttft {result['ttft_s']:6.2f} s  prompt {result['prompt_tokens']}  "
                      f"cached {result['cached_tokens']}  decode {result['decode_tps'] or 0:6.1f} tok/s", flush=True)
    report(rows, args)


def report(rows: dict, args) -> None:
    hot, cold, ref = (rows[k] for k in ("dflash2 (prefix cache)", "dflash2 (cache off)", "mlx_lm.server"))
    print(f"\n{'turn':>4} {'prompt':>6} {'cached':>6} {'cold TTFT':>10} {'hot TTFT':>9} {'hot/cold':>8} "
          f"{'mlx_lm TTFT':>11} {'hot dec':>8} {'cold dec':>8} {'mlx_lm dec':>10}")
    for i, (h, c, r) in enumerate(zip(hot, cold, ref)):
        print(f"{i + 1:>4} {h['prompt_tokens'] or 0:>6} {h['cached_tokens'] or 0:>6} {c['ttft_s']:>9.2f}s "
              f"{h['ttft_s']:>8.2f}s {h['ttft_s'] / c['ttft_s']:>8.1%} {r['ttft_s']:>10.2f}s "
              f"{h['decode_tps'] or 0:>8.1f} {c['decode_tps'] or 0:>8.1f} {r['decode_tps'] or 0:>10.1f}")
    later = range(1, len(hot))
    ratio = sum(hot[i]["ttft_s"] for i in later) / sum(cold[i]["ttft_s"] for i in later)
    same = all(h["text"] == c["text"] for h, c in zip(hot, cold))
    print(f"\nturns 2-{len(hot)}: hot TTFT is {ratio:.1%} of cold; replies with and without the cache "
          f"{'identical' if same else 'DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "turns": rows,
                                               "hot_over_cold_ttft_turns_2_on": ratio,
                                               "replies_identical": same}, indent=1))


if __name__ == "__main__":
    main()
