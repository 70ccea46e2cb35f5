"""Real coding agents against a real `dflash2 serve`: Claude Code (Messages API), Codex (Responses
API) and the OpenAI Agents SDK (Responses API, a function tool), each with and without a drafter.

For each server setting (`--drafter` values) it starts `dflash2 serve MODEL --request-log ...`,
then runs, in a scratch working directory holding `notes.txt`:

* Claude Code: `claude -p PROMPT1 --output-format json`, then `claude -p PROMPT2 --continue`;
* Codex: `codex exec PROMPT` (it must read notes.txt with its shell tool to answer);
* the Agents SDK: an agent with one function tool (`read_notes`) asked the same question.

It prints a table per client and turn (prompt tokens, cached share, time to first token, decode
tok/s, τ) from the server's request log, checks every client finished (exit 0 / an answer), and
that greedy replies are equal with and without the drafter. Writes JSON with `--json`.

    python docs/results/agents/run_agents.py --model qwen2.5-coder-0.5b --drafters none,PATH \\
        --block-size 4 --json docs/results/agents/agents.json

Telemetry is off for both CLIs (DISABLE_TELEMETRY, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC,
Codex `[analytics] enabled = false`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SECRET = "violet-harbor-42"
NOTES = f"Project notes\nThe deploy codename is {SECRET}.\nOwner: platform team.\n"
# Codex's own instructions (~3.5k tokens) replaced, with --codex-instructions short, by these: a 0.5B
# model under the full prompt answers from it instead of reading the file.
# Codex 0.171's shell tool is `exec_command` (a `cmd` string).
SHORT_INSTRUCTIONS = ("You are Codex, a coding agent working in the user's current directory. You cannot "
                      "see any file until you read it: call your `exec_command` tool with a shell command "
                      "in `cmd` (for example `cat FILE`) first, then answer from its output.")
ASK = "What is the deploy codename written in notes.txt? Read the file, then answer with the codename only."
# With the short instructions the task names the command too: asked only to "read the file", the 1.5B
# model wrote a call to an invented `read_file` tool, or called `view_image` on the file.
ASK_COMMAND = ("What is the deploy codename written in notes.txt? Run `cat notes.txt` with exec_command, then "
               "answer with the codename only.")
FOLLOW = "Which team owns the project, according to the same file? Answer in one short sentence."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, drafter: str, log_dir: Path, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.request_log = log_dir / f"requests-{Path(drafter).name}.jsonl"
        self.request_log.unlink(missing_ok=True)
        cmd = [str(Path(sys.executable).parent / "dflash2"), "serve", model, "--drafter", drafter,
               "--port", str(self.port), "--request-log", str(self.request_log), "--max-tokens-cap", "1024", *extra]
        self.log = open(log_dir / f"server-{Path(drafter).name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
        raise TimeoutError("the server did not answer /health")

    def lines(self) -> list[dict]:
        if not self.request_log.exists():
            return []
        return [json.loads(x) for x in self.request_log.read_text().splitlines() if x.strip()]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def claude_code(server: Server, model: str, bin_dir: Path, work: Path, timeout: float) -> list[dict]:
    env = os.environ | {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local", "HOME": str(work / "home"),
                        "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                        "DISABLE_AUTOUPDATER": "1", "ANTHROPIC_MODEL": model,
                        **{f"ANTHROPIC_DEFAULT_{k}_MODEL": model for k in ("OPUS", "SONNET", "HAIKU")}}
    turns = []
    for i, (prompt, extra) in enumerate(((ASK, []), (FOLLOW, ["--continue"]))):
        before = len(server.lines())
        code, out, wall = run([str(bin_dir / "claude"), "-p", prompt, "--output-format", "json", "--max-turns", "4",
                               "--allowedTools", "Read", *extra], work, env, timeout)
        result = _last_json(out)
        turns.append({"client": "claude-code", "turn": i + 1, "exit": code, "wall_s": round(wall, 1),
                      "answer": (result or {}).get("result"), "requests": server.lines()[before:],
                      "raw_tail": out[-1500:] if code or result is None else None})
    return turns


def codex(server: Server, model: str, bin_dir: Path, work: Path, timeout: float,
          instructions: str = "default") -> list[dict]:
    """`codex exec` with the README's provider config: Codex's default 5-minute stream idle timeout
    (the server's heartbeat keeps a long prefill's stream alive) and no retries, so a drop shows."""
    home = work / "codex-home"
    home.mkdir(exist_ok=True)
    short = ""
    if instructions == "short":
        (home / "instructions.md").write_text(SHORT_INSTRUCTIONS + "\n")
        short = f'model_instructions_file = "{home / "instructions.md"}"\n'
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "dflash2"\nweb_search = "disabled"\napproval_policy = "never"\n'
        f'sandbox_mode = "workspace-write"\n{short}\n[model_providers.dflash2]\nname = "dflash2"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nrequest_max_retries = 0\n'
        f'stream_max_retries = 0\n\n[analytics]\nenabled = false\n')
    env = os.environ | {"CODEX_HOME": str(home)}
    before = len(server.lines())
    ask = ASK_COMMAND if instructions == "short" else ASK
    code, out, wall = run([str(bin_dir / "codex"), "exec", "--skip-git-repo-check", ask], work, env, timeout)
    return [{"client": "codex", "turn": 1, "exit": code, "wall_s": round(wall, 1), "answer": out.strip()[-300:],
             "requests": server.lines()[before:], "raw_tail": out[-1500:] if code else None}]


def agents_sdk(server: Server, model: str, work: Path) -> list[dict]:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []  # the tool's own record: a run the SDK aborts later still called it

    @function_tool
    def read_notes() -> str:
        """Read the project's notes.txt file."""
        calls.append("read_notes")
        return (work / "notes.txt").read_text()

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="local", max_retries=0)
    # The first turn must call a tool (tool_choice "required", forced by the server's grammar). The
    # run stops at the tool's output: after it the 0.5B model writes bare JSON instead of an answer,
    # once until max_output_tokens, which the SDK raises on; what is tested is the tool loop.
    agent = Agent(name="helper", instructions="Use the tools to answer.", tools=[read_notes],
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required"), tool_use_behavior="stop_on_first_tool")
    before = len(server.lines())
    t0 = time.perf_counter()
    try:
        result = Runner.run_sync(agent, ASK, max_turns=4)
    except Exception as e:  # noqa: BLE001 - reported in the table as a failed run, not a crash of the driver
        return [{"client": "agents-sdk", "turn": 1, "exit": 1, "wall_s": round(time.perf_counter() - t0, 1),
                 "answer": None, "requests": server.lines()[before:], "tool_calls": len(calls),
                 "raw_tail": f"{type(e).__name__}: {e}"[-1500:]}]
    return [{"client": "agents-sdk", "turn": 1, "exit": 0, "wall_s": round(time.perf_counter() - t0, 1),
             "answer": str(result.final_output), "requests": server.lines()[before:],
             "tool_calls": len(calls)}]


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def summarize(turn: dict) -> dict:
    reqs = [r for r in turn["requests"] if r["prompt_n"] > 0]  # a request cancelled before its prefill has none
    prompt = sum(r["prompt_n"] for r in reqs)
    cached = sum(r["cache_n"] for r in reqs)
    decode = [r["predicted_per_second"] for r in reqs if r["predicted_n"] > 1]
    return {"requests": len(reqs), "prompt_tokens": [r["prompt_n"] for r in reqs],
            "cached_share": round(cached / prompt, 3) if prompt else None,
            "first_request_cached_share": round(reqs[0]["cache_n"] / reqs[0]["prompt_n"], 3) if reqs else None,
            "ttft_s": [round(r["prompt_ms"] / 1e3, 1) for r in reqs],
            "decode_tok_s": round(sum(decode) / len(decode), 2) if decode else None,
            "tau": [r["tokens_per_cycle"] for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--drafters", default="none", help="comma-separated --drafter values, one server each")
    ap.add_argument("--clients", default="claude-code,codex,agents-sdk")
    ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[3] / ".agents" / "node_modules" / ".bin"),
                    help="where `claude` and `codex` are (default: where `make test-real` installs them)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--codex-instructions", choices=("default", "short"), default="default",
                    help="Codex's own instructions, or a 3-line replacement (`model_instructions_file`)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `dflash2 serve` argument")
    ap.add_argument("--block-size", default=None, help="`--block-size` for the servers that have a drafter")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bin_dir, out = Path(args.bin).resolve(), {"model": args.model, "runs": {}}
    for drafter in args.drafters.split(","):
        work = Path(tempfile.mkdtemp(prefix="agents-"))
        (work / "notes.txt").write_text(NOTES)
        (work / "home").mkdir()
        width = ["--block-size", args.block_size] if args.block_size and drafter != "none" else []
        server = Server(args.model, drafter, work, [*args.serve_arg, *width])
        try:
            server.wait()
            turns = []
            if "claude-code" in args.clients:
                turns += claude_code(server, args.model, bin_dir, work, args.timeout)
            if "codex" in args.clients:
                turns += codex(server, args.model, bin_dir, work, args.timeout, args.codex_instructions)
            if "agents-sdk" in args.clients:
                turns += agents_sdk(server, args.model, work)
        finally:
            server.stop()
        for t in turns:
            t["summary"] = summarize(t)
        out["runs"][drafter] = turns
        if args.json:  # after each server, so a later failure keeps what ran
            Path(args.json).write_text(json.dumps(out, indent=1))
        shutil.rmtree(work / "home", ignore_errors=True)
    print("| drafter | client | turn | exit | requests | prompt tokens | cached share | TTFT s | decode tok/s | τ | answer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for drafter, turns in out["runs"].items():
        for t in turns:
            s = t["summary"]
            print(f"| {Path(drafter).name} | {t['client']} | {t['turn']} | {t['exit']} | {s['requests']} | "
                  f"{s['prompt_tokens']} | {s['cached_share']} | {s['ttft_s']} | {s['decode_tok_s']} | {s['tau']} | "
                  f"{(t['answer'] or '')[:60]!r} |")
    runs = list(out["runs"].values())
    if len(runs) > 1:
        out["equal_answers"] = all([t["answer"] for t in runs[0]] == [t["answer"] for t in r] for r in runs[1:])
        print(f"answers equal across drafters: {out['equal_answers']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
