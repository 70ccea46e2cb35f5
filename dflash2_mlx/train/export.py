"""Export a trained drafter for shipping: cast its weights (e.g. to bf16), same published layout.

Training keeps fp32 weights; published drafters are bf16 (half the bytes, and what Apple GPUs
compute in). The cast weights are loaded strictly into a drafter before `save_drafter` writes
them, so a bad export never replaces anything.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlx.core as mx

from ..drafter.config import parse_config
from ..drafter.load import build_drafter, read_checkpoint, save_drafter
from ..drafter.vocab import FILE_NAME
from ..errors import ConfigError

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def export_drafter(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Copy the drafter at `src` (a directory or a training `checkpoint/`) to `out` in `dtype`."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = Path(src)
    if (src / "drafter" / "config.json").exists():  # a training checkpoint directory
        src = src / "drafter"
    raw, weights = read_checkpoint(src)
    cast = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    out = save_drafter(build_drafter(parse_config(raw), cast), out, {"torch_dtype": dtype})
    # The proposal vocab it was trained over travels with it (fit writes it to the run directory).
    for vocab in (src / FILE_NAME, src.parent.parent / FILE_NAME if src.name == "drafter" else None):
        if vocab is not None and vocab.is_file():
            shutil.copyfile(vocab, Path(out) / FILE_NAME)
            break
    return out


def file_size_mb(path: str | os.PathLike) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20
