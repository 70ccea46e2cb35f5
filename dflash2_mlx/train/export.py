"""Export a trained drafter for shipping: cast its weights (e.g. to bf16), same published layout.

Training keeps fp32 weights; published drafters are bf16 (half the bytes, and what Apple GPUs
compute in). The export is checked by loading it back strictly before it replaces anything.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from ..drafter.config import parse_config
from ..drafter.load import build_drafter, read_checkpoint

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def export_drafter(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Copy the drafter at `src` (a directory or a training `checkpoint/`) to `out` in `dtype`.

    Floating tensors are cast; integer tensors (none today) are kept. Returns `out`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    src = Path(src)
    if (src / "drafter" / "config.json").exists():  # a training checkpoint directory
        src = src / "drafter"
    raw, weights = read_checkpoint(src)
    cast = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    build_drafter(parse_config(raw), dict(cast))  # strict: names and shapes as published
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        mx.save_safetensors(str(Path(tmp) / "model.safetensors"), cast, metadata={"format": "mlx"})
        (Path(tmp) / "config.json").write_text(json.dumps(raw | {"torch_dtype": dtype}, indent=2) + "\n")
        for name in ("model.safetensors", "config.json"):
            os.replace(Path(tmp) / name, out / name)
    return out


def file_size_mb(path: str | os.PathLike) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20


__all__ = ["export_drafter", "file_size_mb", "DTYPES"]
