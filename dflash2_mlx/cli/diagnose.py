"""`dflash2 diagnose`: where a drafter loses tokens, per block position (Recall@1 vs Recall@16)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import BlockSizeOpt, DraftBitsOpt, DrafterOpt, ModelArg, print_json, user_errors

EXAMPLES = """
With the target's own greedy continuation of each prompt as ground truth, every generated position \
is an anchor: the drafter sees the target states before it and drafts a block. Per block position: \
Recall@1 (its top-1 is right), Recall@16 (the truth is among its 16 candidates), the selector's pick \
accuracy (given the true previous token), and the acceptance length τ of each way to walk the \
candidates: actual (real speculative decoding), top-1 (DFlash v1), selector (DFlash 2), oracle \
(the truth whenever it is among the 16: the best any selector could do).

Examples:

  dflash2 diagnose                        # demo pair, GSM8K, 4 prompts

  dflash2 diagnose --suite gsm8k,humaneval --n 8 --max-tokens 256 --json diag.json

  dflash2 diagnose ./target --drafter ./drafter --block-size 8 --stride 4
"""


def register(app: typer.Typer) -> None:
    app.command("diagnose", help="Recall@1 vs Recall@16, selector accuracy and τ per block position."
                + EXAMPLES)(diagnose)


@user_errors
def diagnose(
    model: ModelArg = None,
    drafter: DrafterOpt = None,
    suite: Annotated[str, typer.Option("--suite", "-s", help="Comma-separated suites (gsm8k, math500, humaneval, "
                                       "mbpp, mtbench, 'all') or .jsonl files.")] = "gsm8k",
    n: Annotated[int, typer.Option("--n", min=1, help="Prompts per suite (evenly spaced over the set).")] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Ground-truth tokens per prompt.")] = 128,
    block_size: BlockSizeOpt = None,
    stride: Annotated[int, typer.Option("--stride", min=1, help="Use every STRIDE-th position as an anchor.")] = 1,
    top_k: Annotated[Optional[int], typer.Option("--top-k", min=1, help="Candidates for Recall@k and the oracle. "
                                                 "Default: the selector's (16).")] = None,
    draft_bits: DraftBitsOpt = None,
    actual: Annotated[bool, typer.Option("--actual/--no-actual", help="Also decode speculatively for "
                                                                      "τ actual.")] = True,
    bundled: Annotated[bool, typer.Option("--bundled", help="Use the bundled prompt samples.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the figures as JSON to this file "
                                                    "('-' = stdout, tables then go to stderr).")] = None,
) -> None:
    from ..errors import ConfigError
    from ..prompts import load_suites, parse_suites
    from ..session import Session, parse_block_size
    from .bench import _console, _dumps

    size = parse_block_size(block_size)
    if size == "auto":
        raise ConfigError("diagnose needs a fixed --block-size (an integer >= 2), not 'auto'")
    suites = load_suites(parse_suites(suite), n, bundled_only=bundled)
    out = _console(sys.stderr if json_out == "-" else sys.stdout)
    err = _console(sys.stderr)
    session = Session.open(model, drafter=drafter, draft_bits=draft_bits, progress=json_out != "-")
    if session.drafter is None:
        raise ConfigError(f"{session.spec.name} has no drafter to diagnose; pass --drafter")
    for note in session.notes:
        err.print(f"[yellow]note:[/yellow] {note}")
    report = _run_with_progress(session, suites, max_tokens, size, stride, top_k, actual, err)
    report.notes = list(session.notes)
    report.settings.update(model=session.spec.name, target=str(session.spec.target),
                           drafter=str(session.spec.drafter))
    render_report(report, out)
    if json_out == "-":
        print_json(report.to_json())
    elif json_out:
        Path(json_out).write_text(_dumps(report.to_json()))
        err.print(f"wrote {json_out}")


def _run_with_progress(session, suites, max_tokens, size, stride, top_k, actual, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..diagnose import run_diagnose

    total = sum(len(s.prompts) for s in suites)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("diagnosing", total=total)

        def on_prompt(diag):
            progress.update(task, advance=1, description=f"{diag.suite}/{diag.prompt_id}: {len(diag.records)} anchors")

        return run_diagnose(session.target, session.drafter, suites, max_tokens=max_tokens, block_size=size,
                            stride=stride, top_k=top_k, actual=actual, on_prompt=on_prompt)


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def position_table(title: str, stats: dict):
    from rich.table import Table

    k = stats["top_k"]
    has_selector = stats["selector_pick"] is not None
    table = Table(title=title, title_justify="left")
    columns = ["pos", "Recall@1", f"Recall@{k}"]
    if has_selector:
        columns += ["selector", "sel. if recalled"]
    columns += ["acc. top-1", "acc. oracle"] + (["acc. selector"] if has_selector else []) + ["acc. actual"]
    for col in columns:
        table.add_column(col, justify="right")
    cond = stats["conditional_acceptance"]
    for i in range(stats["block_positions"]):
        row = [str(i + 1), _pct(stats["recall_at_1"][i]), _pct(stats["recall_at_k"][i])]
        if has_selector:
            row += [_pct(stats["selector_pick"][i]), _pct(stats["selector_pick_when_recalled"][i])]
        row += [_pct(cond["top1"][i]), _pct(cond["oracle"][i])]
        if has_selector:
            row.append(_pct(cond["selector"][i]))
        actual = cond.get("actual") or []
        row.append(_pct(actual[i]) if i < len(actual) else "—")
        table.add_row(*row)
    return table


def tau_table(report):
    from rich.table import Table

    table = Table(title="acceptance length τ (tokens per cycle, bonus included)", title_justify="left")
    for col in ("suite", "prompts", "anchors", "actual", "top-1 walk", "selector walk", "oracle", "≠ truth"):
        table.add_column(col, justify="left" if col == "suite" else "right")
    scopes = [("all", report.stats())] + [(s["name"], report.stats(s["name"])) for s in report.suites]
    for name, s in scopes:
        if not s.get("n_anchors"):
            table.add_row(name, str(s["n_prompts"]), "0", *["—"] * 5)
            continue
        tau = s["tau"]
        fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        table.add_row(name, str(s["n_prompts"]), str(s["n_anchors"]), fmt(tau.get("actual")), fmt(tau["top1"]),
                      fmt(tau.get("selector")), fmt(tau["oracle"]), str(s["actual_mismatches"]))
    return table


def render_report(report, console) -> None:
    st = report.settings
    overall = report.stats()
    if overall.get("n_anchors"):
        console.print(position_table(f"{st['drafter_arch']} drafter, block size {st['block_size']}, "
                                     f"{overall['n_anchors']} anchors over {st['n_prompts']} prompts "
                                     f"({st['max_tokens']} greedy tokens each)", overall))
    console.print(tau_table(report))
    console.print("Percentages. Recall@1 low but Recall@k high: the right token was a candidate but not first (the "
                  "selector's job); Recall@k low: the drafter never proposed it. selector: picks the truth given the "
                  "true previous token ('if recalled': when the truth is a candidate). acc. X: P(position right | "
                  "positions before it right) walking the candidates X's way.")
    if overall.get("actual_mismatches"):
        console.print(f"[yellow]{overall['actual_mismatches']} speculative outputs differ from the greedy ground "
                      "truth (float round-off can flip a near-tie)[/yellow]")
