"""`dflash2 convert`: GGUF → MLX, and HF/MLX directory or repo → MLX (quantized)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .common import JsonOpt, print_json, user_errors

EXAMPLES = """
Examples:

  dflash2 convert model.gguf ./model-mlx                 # dequantize to bfloat16

  dflash2 convert model.gguf ./model-mlx-4bit -q 4       # dequantize, then quantize with MLX

  dflash2 convert Qwen/Qwen3-4B ./qwen3-4b-4bit -q 4      # HF repo → 4-bit MLX

  dflash2 convert model.gguf ./exact --dtype float32     # the GGUF's values, exactly
"""


def register(app: typer.Typer) -> None:
    app.command("convert", help="Convert a GGUF file or an HF/MLX model to an MLX model directory."
                + EXAMPLES)(convert)


@user_errors
def convert(
    src: Annotated[str, typer.Argument(help="A .gguf file (llama, qwen2, qwen3, gemma3), a model directory, "
                                            "or a Hugging Face repo id.")],
    out: Annotated[str, typer.Argument(help="Output directory (must not exist unless --overwrite).")],
    q_bits: Annotated[Optional[int], typer.Option("--q-bits", "-q", help="Quantize to 4 or 8 bits with MLX.")] = None,
    group_size: Annotated[int, typer.Option("--group-size", help="Quantization group size (32, 64, 128).")] = 64,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="float32, bfloat16 or float16 for unquantized weights and scales "
                        "(default: bfloat16 for GGUF, the model's own otherwise).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    json_out: JsonOpt = False,
) -> None:
    from pathlib import Path

    from .. import convert as conv
    from .. import hub
    from ..errors import ResolveError
    from ..paths import dir_size, human_bytes

    source = Path(src).expanduser()
    if not source.exists():  # an alias or a repo id, resolved as `dflash2 run` resolves MODEL
        if hub.looks_like_path(src):
            raise ResolveError(f"source {src!r} does not exist (expected a .gguf file, a model directory, "
                               "an alias or a Hugging Face repo id)")
        source = hub.target_dir(src, progress=not json_out)
    elif source.is_file() and source.suffix.lower() != ".gguf":
        raise ResolveError(f"source {src!r} is a file but not a .gguf file")
    result = conv.convert(source, Path(out).expanduser(), q_bits=q_bits, group_size=group_size, dtype=dtype,
                          overwrite=overwrite, progress=not json_out)
    info = {"source": str(source), "out": str(result), "bytes": dir_size(result), "q_bits": q_bits,
            "group_size": group_size if q_bits else None,
            "dtype": dtype or ("bfloat16" if source.suffix.lower() == ".gguf" else None)}
    if json_out:
        print_json(info)
        return
    typer.echo(f"wrote {result} ({human_bytes(info['bytes'])}); run it with: dflash2 run {result}")
