"""`dflash2 models`: the registry (alias → target + drafter + defaults) and what is cached."""

from __future__ import annotations

import typer

from .common import JsonOpt, print_json, user_errors

EXAMPLES = """
Examples:

  dflash2 models                  # the alias table, with cached sizes

  dflash2 models --json           # the same as one JSON object
"""


def register(app: typer.Typer) -> None:
    app.command("models", help="List model aliases and what is cached locally." + EXAMPLES)(models)


def _describe(alias: str, entry: dict) -> dict:
    from .. import assets, hub, paths

    _, target, drafter = hub.locate(alias)
    row = {"alias": alias, "target": entry["target"], "drafter": entry.get("drafter"),
           "defaults": entry.get("defaults", {}), "params": entry.get("params"),
           "description": entry.get("description", ""),
           "offline_fallback": " ".join(assets.requirements(entry["target_wheel"]))
           if "target_wheel" in entry else None, "notes": entry.get("notes", [])}
    row["target_cached"] = str(target.path) if target.path else None
    row["target_bytes"] = paths.dir_size(target.path) if target.path else 0
    row["drafter_cached"] = str(drafter.path) if drafter and drafter.path else None
    row["drafter_bytes"] = paths.dir_size(drafter.path) if drafter and drafter.path else 0
    row["drafter_untrained"] = bool(drafter and drafter.untrained)
    return row


@user_errors
def models(json_out: JsonOpt = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from .. import paths
    from ..registry import load_registry

    registry = load_registry()
    rows = [_describe(alias, entry) for alias, entry in registry.models.items()]
    if json_out:
        print_json({"default": registry.default, "registry": str(registry.path), "cache": str(paths.home()),
                    "hf_cache": str(paths.hf_cache()), "models": rows})
        return
    table = Table(title=f"dflash2 models (default: {registry.default}; * works offline)", title_justify="left")
    table.add_column("alias", no_wrap=True)
    for column in ("target", "drafter", "defaults", "cached"):
        table.add_column(column, overflow="fold")
    for row in rows:
        drafter = (row["drafter"] or "-").replace("shipped:", "models/")
        table.add_row(row["alias"] + ("*" if row["offline_fallback"] else ""), row["target"],
                      drafter + (" (untrained stand-in)" if row["drafter_untrained"] else ""),
                      _defaults_cell(row["defaults"]), _cached_cell(row))
    Console().print(table)
    offline = sorted({r["offline_fallback"] for r in rows if r["offline_fallback"]})
    if offline:
        typer.echo(f"* offline, the target comes from PyPI: {', '.join(offline)}")
    typer.echo(f"cache: {paths.home()}  ·  hf cache: {paths.hf_cache()}  ·  fetch: dflash2 download ALIAS")


def _defaults_cell(defaults: dict) -> str:
    parts = []
    if "block_size" in defaults:
        parts.append(f"block {defaults['block_size']}")
    if "draft_bits" in defaults:
        parts.append(f"draft {defaults['draft_bits']}-bit")
    if "dtype" in defaults:
        parts.append(defaults["dtype"])
    return ", ".join(parts)


def _cached_cell(row: dict) -> str:
    from ..paths import human_bytes

    target = human_bytes(row["target_bytes"]) if row["target_cached"] else "no"
    if row["drafter"] is None:
        return f"target {target}"
    drafter = human_bytes(row["drafter_bytes"]) if row["drafter_cached"] else "no"
    return f"{target} + {drafter}"
