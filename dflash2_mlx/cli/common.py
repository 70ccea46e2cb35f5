"""Shared CLI pieces: option aliases, error handling, output helpers."""

from __future__ import annotations

import functools
import json
import sys
from typing import Annotated, Optional

import typer

ModelArg = Annotated[
    Optional[str],
    typer.Argument(help="Alias from `dflash2 models`, a local model directory, a Hugging Face repo id, "
                        "or a .gguf file. Default: the built-in demo pair."),
]
DrafterOpt = Annotated[
    Optional[str],
    typer.Option("--drafter", "-d", help="Drafter directory or HF repo, or 'none' for plain decoding. "
                                          "Default: the model's registered drafter."),
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature; 0 = greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Keep the k most likely tokens (0 = off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="RNG seed; the same seed repeats a sampled run.")]
BlockSizeOpt = Annotated[
    Optional[str],
    typer.Option("--block-size", "-b", help="Verify width (drafts + 1), an integer >= 2, or 'auto' to pick it "
                                             "from measured costs. Default: the model's registered value."),
]
DraftBitsOpt = Annotated[Optional[int], typer.Option("--draft-bits", help="Quantize the drafter to 4 or 8 bits.")]
DraftVocabOpt = Annotated[Optional[int], typer.Option("--draft-vocab", min=0, help="Draft among the N most frequent "
                                                      "ids of the drafter's proposal_vocab.json (0 = the full "
                                                      "head). Default: the file's size when it is there.")]
KvBitsOpt = Annotated[Optional[int], typer.Option("--kv-bits", help="Store the target's full-attention K/V "
                                              "quantized to 4 or 8 bits (mlx-lm's QuantizedKVCache): less memory at "
                                              "long context; output equals plain decoding with the same "
                                              "quantization. Attention reads it dequantized, at float speed.")]
KvGroupSizeOpt = Annotated[Optional[int], typer.Option("--kv-group-size", help="Quantization group of --kv-bits: 32, "
                                                       "64 or 128 (default 64, or 32 where 64 does not divide the "
                                                       "head dimension).")]
ShardOpt = Annotated[str, typer.Option("--shard", help="Under mlx.launch: how the target is split over the ranks: "
                                                     "tensor (each layer's heads; most families) or pipeline "
                                                     "(consecutive layers per rank, where mlx-lm can: qwen3_5, "
                                                     "deepseek_v41, kimi_k3, ...). The drafter runs on rank 0.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


def fail(message: str) -> None:
    """Print one error line and exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def user_errors(fn):
    """Turn `DFlashError` and `typer.BadParameter` raised in the command into one line + exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..errors import DFlashError

        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            fail(str(e))
        except typer.BadParameter as e:  # a bad value found inside the command: one line too, not a usage box
            fail(e.message)
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(130)

    return wrapper


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def warn_slow_blas() -> None:
    """One stderr line when MLX computes on the slow reference BLAS; call once per command."""
    import mlx.core  # noqa: F401  (loads the BLAS that active_blas() looks for)

    from .. import blas

    line = blas.slow_blas_warning()
    if line:
        typer.echo(line, err=True)


def prepare_process() -> None:
    """Process-wide setup before any command runs (e.g. a faster BLAS on Linux)."""
    import os

    from .. import blas

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner

    blas.maybe_reexec_with_openblas()
