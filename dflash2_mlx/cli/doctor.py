"""`dflash2 doctor`: the MLX runtime, kernels, BLAS, caches, and a memory estimate for MODEL."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .common import DraftBitsOpt, DrafterOpt, DraftVocabOpt, JsonOpt, print_json, user_errors

EXAMPLES = """
Examples:

  dflash2 doctor                                # this machine: MLX backend, memory, kernels, BLAS, caches

  dflash2 doctor Qwen3.8-27B --context 32768    # will the pair fit? (before downloading weights, if online)

  dflash2 doctor ./my-model --drafter ./my-drafter --json
"""


def register(app: typer.Typer) -> None:
    app.command("doctor", help="Check the MLX setup and estimate a model's memory before loading it."
                + EXAMPLES)(doctor)


@user_errors
def doctor(
    model: Annotated[Optional[str], typer.Argument(help="Alias, model directory, HF repo id or .gguf file to "
                                                        "estimate memory for.")] = None,
    drafter: DrafterOpt = None,
    context: Annotated[int, typer.Option("--context", "-c", min=1, help="Context length for the KV estimate.")] = 4096,
    draft_bits: DraftBitsOpt = None,
    draft_vocab: DraftVocabOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from .. import doctor as lib

    report = {"environment": lib.environment()}
    if model is not None:
        report["memory"] = lib.estimate_memory(model, drafter, context=context, draft_bits=draft_bits,
                                               draft_vocab=draft_vocab)
    if json_out:
        print_json(report)
        return
    for line in render(report):
        typer.echo(line)


def _gb(n) -> str:
    from ..paths import human_bytes

    return human_bytes(n) if n else "?"


def render(report: dict) -> list[str]:
    env = report["environment"]
    dev, blas, kern, cache = env["device"], env["blas"], env["kernels"], env["cache"]
    lines = [f"dflash2 {env['dflash2']} · Python {env['python']} · {env['platform']}",
             f"MLX {dev['mlx']} · backend {dev['backend']} ({dev['default_device']}, {dev['device_name']}) · "
             f"memory {_gb(dev['memory_bytes'])}"
             + (f", recommended working set {_gb(dev['recommended_working_set_bytes'])}"
                if dev["recommended_working_set_bytes"] else ""),
             f"selector: {kern.get('selector')} ({kern.get('reason', '')})"]
    active = blas["active"]
    speed = "fast" if active["fast"] else "slow" if active["fast"] is False else "unknown"
    lines.append(f"BLAS: {active['name']} ({speed}){' · ' + active['library'] if active['library'] else ''}")
    lines.append(f"  CLI re-exec: {blas['cli_reexec']} · opt out: {blas['opt_out']} · {blas['advice']}")
    if blas.get("found"):
        found = blas["found"]
        lines.append(f"  fast BLAS found: {found['name']} {found['library']} ({found['source']})"
                     + "".join(f" {k}={v}" for k, v in found["env"].items()))
    lines.append(f"cache: {cache['home']} ({_gb(cache['home_bytes'])})")
    lines += [f"  {e['path']} ({_gb(e['bytes'])})" for e in cache["entries"]]
    repos = ", ".join(f"{r['repo']} ({_gb(r['bytes'])})" for r in cache["hf_registry_repos"]) or "none"
    lines.append(f"HF cache: {cache['hf_cache']} · registry models cached: {repos}"
                 + (" · HF_HUB_OFFLINE=1" if env["hf_offline"] else ""))
    group = env.get("distributed")
    lines.append(f"distributed: rank {group['rank']} of {group['size']} ({group['backend']}, {group['mode']} "
                 f"parallel) · holds {group['holds']}" if group else
                 "distributed: not launched (`mlx.launch --hosts ... dflash2 run ...` shards the target)")
    cals = env["calibrations"]
    lines.append(f"block-size calibrations: {len(cals)}" if cals else
                 "block-size calibrations: none (made by `dflash2 bench --calibrate`)")
    lines += [f"  {c.get('target')} + {c.get('drafter')} · {c.get('machine')} · {c.get('created')}" for c in cals]
    if "memory" in report:
        lines += _render_memory(report["memory"])
    return lines


def _render_vocab(pv: dict) -> str:
    if not pv["active"]:
        return f"  draft vocab: full head ({pv['reason']})"
    src = pv["source"]
    cov = f", {pv['coverage']:.1%} held-out coverage" if pv.get("coverage") else ""
    return (f"  draft vocab: compact head, {pv['size']} of {pv['vocab_size']} ids{cov} · {pv['path']} "
            f"({src.get('built_by', '?')}, {src.get('sharegpt_conversations', 0)} ShareGPT conversations, "
            f"{src.get('target_response_tokens', 0)} target-response tokens, {src.get('created', '?')})")


def _render_memory(mem: dict) -> list[str]:
    if mem.get("unavailable"):
        return [f"memory estimate for {mem['model']}: unavailable ({mem['unavailable']})"]
    t, d = mem["target"], mem["drafter"]
    lines = [f"memory estimate for {mem['model']} at {mem['context']} tokens:",
             f"  target   weights {_gb(t['weights_bytes'])} + KV {_gb(t['kv_bytes'])} "
             f"({_gb(t['kv_bytes_per_1k'])} per 1k tokens) [{t['source']}]"]
    if d:
        lines.append(f"  drafter  weights {_gb(d['weights_bytes'])} + KV {_gb(d['kv_bytes'])} [{d['source']}]"
                     + (" (untrained stand-in)" if d["untrained"] else ""))
        if "proposal_vocab" in d:
            lines.append(_render_vocab(d["proposal_vocab"]))
    verdict = "unknown" if mem["fits"] is None else "fits" if mem["fits"] else "does NOT fit"
    lines.append(f"  total ≈ {_gb(mem['total_bytes'])} (+10% overhead) of {_gb(mem['device_bytes'])}: {verdict}")
    lines += [f"  note: {n}" for n in mem["notes"]]
    return lines
