"""`dflash2 bench`: measured speed of plain decoding vs DFlash vs DFlash 2 on offline suites."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    BlockSizeOpt,
    DraftBitsOpt,
    DrafterOpt,
    DraftVocabOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    ModelArg,
    SeedOpt,
    TempOpt,
    TopPOpt,
    print_json,
    user_errors,
    warn_slow_blas,
)

EXAMPLES = """
Modes: [bold]ar[/bold] = plain decoding (the baseline); [bold]mlx_lm[/bold] = mlx_lm.stream_generate \
itself on the same model (the reference: adds a "× mlx-lm" column); [bold]dflash[/bold] = the DFlash v1 drafter \
(--drafter-v1, default: the registry's v1 drafter for this target); [bold]dflash2[/bold] = the DFlash 2 \
drafter (--drafter, default: the registry's). Append @WIDTH or @auto to a mode to set its block size, \
e.g. dflash2@4; otherwise --block-size (or the drafter's own) applies.

Every mode decodes every prompt in one process, interleaved and in rotating order, after an untimed \
warm-up. Outputs ending in a short exact loop are flagged; speedups are shown with and without them.

Examples:

  dflash2 bench                           # demo pair: 5 suites x 8 prompts

  dflash2 bench --suite gsm8k,humaneval --n 4 --max-tokens 128 --json b.json --plot b.png

  dflash2 bench --modes mlx_lm,ar,dflash2@4                # against mlx-lm itself

  dflash2 bench --modes ar,dflash2@2,dflash2@4,dflash2@8,dflash2@auto   # fixed vs auto

  dflash2 bench ./target --drafter ./v2 --drafter-v1 ./v1 --temp 0.7 --seed 1

  dflash2 bench --suite my_prompts.jsonl --json -      # your prompts; JSON on stdout

  dflash2 bench --context 4096,16384 --n 2 --modes mlx_lm,ar,dflash2@4 --kv-bits 8   # agent-sized prompts

  dflash2 bench --context 16384 --n 1 --repeats 3 --modes mlx_lm,ar,dflash2@auto   # prefill once, decode 3x

  dflash2 bench --context 28672 --n 1 --turn-tokens 512 --kv-bits 8 --modes mlx_lm,ar   # one agent turn

  dflash2 bench --calibrate               # re-measure the costs behind 'auto'
"""

DEFAULT_MODES = "ar,dflash,dflash2"


def register(app: typer.Typer) -> None:
    app.command("bench", help="Measure speedup vs plain decoding on GSM8K, MATH-500, HumanEval, MBPP, MT-Bench."
                + EXAMPLES)(bench)


@user_errors
def bench(
    model: ModelArg = None,
    suite: Annotated[Optional[str], typer.Option("--suite", "-s", help="Comma-separated suites: gsm8k, math500, "
                                                 "humaneval, mbpp, mtbench, 'all', or .jsonl files of "
                                                 "{\"prompt\": ...}. [default: all, or none with --context]")] = None,
    context: Annotated[Optional[str], typer.Option("--context", metavar="N[,N...]", help="Long-context suites: "
                                                   "prompts of about N tokens (this package's own sources and a "
                                                   "question about them), e.g. 4096,16384; read prefill tok/s, "
                                                   "TTFT and peak memory beside decode speed.")] = None,
    n: Annotated[int, typer.Option("--n", min=1, help="Prompts per suite (evenly spaced over the set).")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate per prompt.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Decodes of each prompt per mode: the first "
                                         "prefills it, the others decode again from the mode's prompt cache "
                                         "(mlx-lm's for mlx_lm), interleaved. Use with --context: the prompt is "
                                         "prefilled once per mode and decode speed averages over repeats.")] = 1,
    turn_tokens: Annotated[Optional[int], typer.Option("--turn-tokens", min=1, metavar="K", help="An agent's "
                                                       "turn: every run starts from a prompt cache holding all "
                                                       "but the prompt's last K tokens (prefilled once, "
                                                       "untimed, copied to every mode, mlx_lm's too), so "
                                                       "prefill tok/s and TTFT measure those K tokens, e.g. "
                                                       "--context 28672 --turn-tokens 512.")] = None,
    modes: Annotated[Optional[str], typer.Option("--modes", "-m", help="Comma-separated modes: ar, dflash, "
                                                 "dflash2, each optionally @WIDTH or @auto. [default: "
                                                 f"{DEFAULT_MODES}, skipping modes without a drafter]")] = None,
    drafter: DrafterOpt = None,
    drafter_v1: Annotated[Optional[str], typer.Option("--drafter-v1", help="DFlash (v1) drafter for the 'dflash' "
                                                      "mode. Default: the registry's v1 drafter for this "
                                                      "target.")] = None,
    draft_bits: DraftBitsOpt = None,
    draft_vocab: DraftVocabOpt = None,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    block_size: BlockSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write every raw figure as JSON to this file "
                                                    "('-' = stdout, tables then go to stderr).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of acceptance by block position "
                                                 "(needs matplotlib: pip install matplotlib).")] = None,
    bundled: Annotated[bool, typer.Option("--bundled", help="Use the bundled prompt samples even when the full "
                                          "sets are installed.")] = False,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One untimed generation per mode first.")] = True,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Re-measure this machine's target/drafter costs "
                                            "for --block-size auto, print them, and exit.")] = False,
) -> None:
    from .. import bench as lib
    from ..core.sampling import SamplingParams
    from ..prompts import load_suites, parse_suites
    from ..session import parse_block_size

    size = parse_block_size(block_size)
    requested = lib.parse_modes(modes or DEFAULT_MODES)
    lengths = _context_lengths(context)
    suites = load_suites(parse_suites(suite or "all"), n, bundled_only=bundled) if suite or not lengths else []
    sampling = SamplingParams(temperature=temp, top_p=top_p, seed=seed)
    if plot is not None:
        _require_matplotlib()
    out = _console(sys.stderr if json_out == "-" else sys.stdout)
    err = _console(sys.stderr)
    target, drafters, notes, spec = _open_pair(model, drafter, drafter_v1, draft_bits, progress=json_out != "-",
                                               draft_vocab=draft_vocab)
    if calibrate:
        warn_slow_blas()
        return _calibrate(target, drafters, out, size)
    if lengths:
        from ..long_context import context_suite

        suites += [context_suite(target.tokenizer, lib.default_encoder(target), k, n) for k in lengths]
    mode_list, mode_notes = lib.build_modes(requested, drafters, size, required=modes is not None)
    warn_slow_blas()
    notes += mode_notes
    for note in notes:
        err.print(f"[yellow]note:[/yellow] {note}")
    kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
    report = _run_with_progress(lib, target, mode_list, suites, max_tokens, sampling, warmup, err, kv, repeats,
                                turn_tokens)
    report.notes = notes
    report.settings.update(model=spec.name, target=str(spec.target), suites=[s.name for s in suites], n=n)
    render_report(report, out)
    if json_out == "-":
        print_json(report.to_json())
    elif json_out:
        Path(json_out).write_text(_dumps(report.to_json()))
        err.print(f"wrote {json_out}")
    if plot is not None:
        from ..bench_plot import plot_acceptance

        plot_acceptance(report, plot)
        err.print(f"wrote {plot}")


def _console(file):
    from rich.console import Console

    return Console(file=file, width=None if file.isatty() else 160)


def _dumps(obj) -> str:
    import json

    return json.dumps(obj, indent=1, default=str) + "\n"


def _require_matplotlib() -> None:
    import importlib.util

    from ..errors import ConfigError

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'dflash2-mlx[plot]'")


# -- model pair -------------------------------------------------------------------------


def _open_pair(model, drafter, drafter_v1, draft_bits, progress: bool, draft_vocab: int | None = None):
    """Target plus drafters by kind: {"dflash2": (drafter, path), "dflash": (drafter, path)}."""
    from .. import hub
    from ..bench import drafter_kind
    from ..errors import ConfigError
    from ..hub import load_drafter
    from ..session import Session

    session = Session.open(model, drafter=drafter, draft_bits=draft_bits, progress=progress, draft_vocab=draft_vocab)
    spec, notes = session.spec, list(session.notes)
    drafters = {}
    if session.drafter is not None:
        drafters[drafter_kind(session.drafter)] = (session.drafter, spec.drafter)
    v1_path = None
    if drafter_v1 is not None:
        v1_path = hub.resolve(model, drafter_v1, progress=progress).drafter
    elif "dflash" not in drafters and drafter is None:
        v1_path, v1_notes = _registry_v1_drafter(spec, progress)
        notes += v1_notes
    if v1_path is not None:
        v1 = load_drafter(v1_path, session.target, draft_bits=draft_bits)
        if drafter_kind(v1) != "dflash":
            raise ConfigError(f"--drafter-v1 {v1_path} is a {v1.config.arch} drafter, not DFlash v1")
        drafters["dflash"] = (v1, v1_path)
    return session.target, drafters, notes, spec


def _registry_v1_drafter(spec, progress: bool):
    """The v1 drafter of another registry alias with the same target (e.g. smollm2-demo-v1)."""
    import json

    from .. import hub
    from ..registry import load_registry

    registry = load_registry()
    entry = registry.models.get(spec.name)
    if entry is None:
        return None, []
    for alias, other in registry.models.items():
        if alias == spec.name or other.get("target") != entry.get("target"):
            continue
        other_spec = hub.resolve(alias, progress=progress)
        if other_spec.drafter is None:
            continue
        arch = json.loads((Path(other_spec.drafter) / "config.json").read_text()).get("architectures", [""])[0]
        if arch in ("DFlashDraftModel", "MuseGlimmerAssistantModel"):
            notes = [n for n in other_spec.notes if n not in spec.notes or "drafter" in n]
            return other_spec.drafter, [f"dflash mode uses {alias}'s drafter: {n}" for n in notes]
    return None, []


# -- running ----------------------------------------------------------------------------


def _context_lengths(value: str | None) -> list[int]:
    if not value:
        return []
    from ..errors import ConfigError

    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--context takes token counts like 4096,16384, got {value!r}") from None


def _run_with_progress(lib, target, modes, suites, max_tokens, sampling, warmup, console, kv, repeats=1,
                       turn_tokens=None):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    total = sum(len(s.prompts) for s in suites) * len(modes) * repeats
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming up" if warmup else "benchmarking", total=total)

        done = itertools.count(1)

        def on_run(record):
            progress.update(task, advance=1, description=f"{record.suite}/{record.prompt_id} {record.mode}: "
                                                           f"{record.decode_tps:.1f} tok/s")
            if not console.is_terminal:  # a log of an hours-long run keeps each run's figures as it ends
                console.print(run_line(record, next(done), total))

        return lib.run_bench(target, modes, suites, max_tokens=max_tokens, sampling=sampling, warmup=warmup,
                             on_run=on_run, repeats=repeats, turn_tokens=turn_tokens, **kv)


def run_line(record, done: int, total: int) -> str:
    """One finished run, for a log: prefill, TTFT, decode and τ as they stand."""
    tau = "" if record.tau is None else f", τ {record.tau:.2f}"
    return (f"run {done}/{total} {record.suite}/{record.prompt_id} {record.mode} (repeat {record.repeat}): "
            f"{_prompt_part(record)} {record.prompt_tps:.1f} tok/s, "
            f"TTFT {record.ttft_s:.1f} s, "
            f"decode {record.decode_tps:.2f} tok/s{tau}")


def _prompt_part(record) -> str:
    if record.n_prefilled <= 1:
        return "cached prompt"
    return f"prefill of {record.n_prefilled} after {record.n_cached} cached" if record.n_cached else "prefill"


def _calibrate(target, drafters, console, size) -> None:
    from rich.table import Table

    from ..core.block_policy import break_even_acceptance
    from ..core.calibration import get_calibration

    if not drafters:
        from ..errors import ConfigError

        raise ConfigError("--calibrate needs a drafter (the model has none; pass --drafter)")
    for kind, (drafter, path) in sorted(drafters.items()):
        width = size if isinstance(size, int) else drafter.config.block_size
        cal = get_calibration(target, drafter, width, refresh=True,
                              progress=lambda done, total: console.print(f"  round {done}/{total}", end="\r"))
        table = Table(title=f"{kind} drafter {path}: costs on {cal.machine.get('summary')}")
        for col in ("width", "target ms", "drafter ms", "cycle / plain", "break-even acceptance",
                    f"growth with context (to {cal.slope_context} tokens)"):
            table.add_column(col, justify="right")
        for w in range(1, cal.costs.max_width + 1):
            be = break_even_acceptance(cal.costs, w) if w > 1 else None
            table.add_row(str(w), f"{1e3 * cal.costs.target_s[w - 1]:.2f}", f"{1e3 * cal.costs.draft_s[w - 1]:.2f}",
                          f"{cal.costs.cycle_s(w) / cal.costs.cycle_s(1):.2f}",
                          "—" if w == 1 else ("never" if be is None else f"{be:.2f}"), f"{cal.costs.growth(w):.2f}")
        console.print(table)


# -- tables -----------------------------------------------------------------------------


def _f(value, fmt: str, none: str = "—") -> str:
    return none if value is None else format(value, fmt)


def speed_table(title: str, figures: dict, clean: dict, adaptive: set[str] = frozenset()):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    reference = any(f.get("speedup_vs_mlx_lm") for f in figures.values())
    columns = ["mode", "runs", "prefill tok/s", "TTFT ms", "decode tok/s", "speedup", "w/o loops"]
    columns += ["× mlx-lm"] if reference else []
    columns += ["τ", "width", "cycle ms", "cycle/(d+v)", "peak GB", "loops", "≠ AR"]
    for col in columns:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, f in figures.items():
        c = clean.get(mode, {})
        cells = [mode, str(f["n_runs"]), _f(f["prompt_tps"], ".0f"), _f(1e3 * f["ttft_s"], ".0f"),
                 _f(f["decode_tps"], ".1f"), _times(f["speedup"]), _times(c.get("speedup"))]
        cells += [_times(f.get("speedup_vs_mlx_lm"))] if reference else []
        cells += [_f(f["tau"], ".2f"), _width(f, mode in adaptive), _f(f.get("cycle_ms"), ".1f"),
                  _f(f.get("cycle_over_isolated"), ".2f"), _f(f["peak_memory_gb"], ".2f"), str(f["n_loops"]),
                  str(f["n_mismatch_vs_ar"])]
        table.add_row(*cells)
    return table


def _times(value) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _width(f: dict, adaptive: bool) -> str:
    """Mean speculative width; for 'auto' also the share of cycles the policy decoded plainly."""
    if f["tau"] is None:
        return "all plain" if adaptive and f["plain_steps"] else "—"
    plain = f["plain_steps"] / max(f["plain_steps"] + f["n_speculative_cycles"], 1)
    return f"{f['mean_width']:.1f}" + (f" ({plain:.0%} plain)" if adaptive else "")


def acceptance_table(summary: dict):
    """Conditional acceptance by block position, per suite and mode (the blog's Figure 5)."""
    from rich.table import Table

    rows = [(scope, mode, f) for scope, figs in [("all", summary["overall"]), *summary["by_suite"].items()]
            for mode, f in figs.items() if f["tau"] is not None]
    depth = max((len(f["acceptance_by_position"]) for _, _, f in rows), default=0)
    table = Table(title="P(draft accepted | earlier drafts accepted) by block position (cycles that reached it)",
                  title_justify="left")
    table.add_column("suite")
    table.add_column("mode")
    table.add_column("τ", justify="right")
    for i in range(depth):
        table.add_column(str(i + 1), justify="right")
    for scope, mode, f in rows:
        cells = [f"{_f(v, '.2f')} ({n})" for v, (_, n) in zip(f["acceptance_by_position"], f["acceptance_counts"])]
        table.add_row(scope, mode, _f(f["tau"], ".2f"), *(cells + [""] * (depth - len(cells))))
    return table


def render_report(report, console) -> None:
    summary, clean = report.summary(), report.summary(exclude_loops=True)
    adaptive = {m["name"] for m in report.modes if m.get("block_size") == "auto"}
    for s in report.suites:
        name = s["name"]
        console.print(speed_table(f"{name}: {s['n']} prompts", summary["by_suite"][name],
                                  clean["by_suite"].get(name, {}), adaptive))
    console.print(speed_table(f"all suites ({report.settings['n_prompts']} prompts, "
                              f"{report.settings['max_tokens']} max tokens)", summary["overall"], clean["overall"],
                              adaptive))
    if any(f["tau"] is not None for f in summary["overall"].values()):
        console.print(acceptance_table(summary))
    for s in report.suites:
        console.print(f"prompts {s['name']}: {s['source']}")
    settings = report.settings
    kv = f"{settings['kv_bits']}-bit (groups of {settings['kv_group_size']})" if settings.get("kv_bits") else "full"
    console.print(f"target K/V: {kv}, {settings['kv_cache_bytes_per_token'] / 1024:.1f} KiB per token of context")
    if settings.get("turn_tokens"):
        console.print(f"each run prefilled the prompt's last {settings['turn_tokens']} tokens after a cached prefix "
                      "(--turn-tokens): prefill tok/s and TTFT are the turn's")
    loops = report.looping_prompts()
    if loops:
        console.print(f"looping outputs (last {report.settings['loop_window']} tokens repeat): "
                      + ", ".join(f"{s}/{p}" for s, p in sorted(loops)) + " — excluded from 'excl. loops'")
    mismatches = sum(r.matches_ar is False for r in report.records)
    if mismatches:
        console.print(f"[yellow]{mismatches} greedy outputs differ from plain decoding (float round-off between "
                      "batched and single-token forwards can flip a near-tie)[/yellow]")
