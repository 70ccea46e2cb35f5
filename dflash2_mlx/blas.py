"""Linux: MLX's CPU wheel bundles a slow reference BLAS; preload a fast one.

The `mlx-cpu` wheel ships netlib's reference `libblas` in `mlx_cpu.libs/`. Preloading a fast BLAS
(`LD_PRELOAD`) interposes its `sgemm` & co.: a width-8 verify pass then costs 1.2-1.8x one token
instead of ~7x, prefill runs ~24x faster and the demo decodes ~5x faster (docs/results/blas). The
CLI re-executes itself once with it preloaded when: Linux, the bundled reference BLAS is present,
a fast BLAS exists, nothing is preloaded yet, and `DFLASH2_NO_OPENBLAS` is not `1`.

Search order (fastest first, as measured): `$DFLASH2_OPENBLAS` (a path), MKL if pip installed it,
the system OpenBLAS (`apt install libopenblas0-pthread`), then the OpenBLAS bundled in the
`faiss-cpu` wheel (a default dependency on Linux x86_64). `DFLASH2_BLAS_IGNORE_SYSTEM=1` skips the
system libraries, to check what a machine without them gets. `describe()` reports what this
process actually uses (for `doctor`).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)
# Pip-installed fast BLAS libraries: (where, glob); "site" is a site-packages folder, "data" a
# prefix's lib/. MKL (`pip install mkl`) ran fastest here, so it goes before the system OpenBLAS;
# faiss-cpu's bundled OpenBLAS (a default dependency on Linux x86_64) after it (docs/results/blas).
PIP_MKL = ("data", "libmkl_rt.so*")
PIP_OPENBLAS = ("site", "faiss_cpu.libs/libopenblas*.so*")
# Libraries an auditwheel-repaired wheel bundles next to its OpenBLAS, in load order: the
# renamed copies carry no RPATH, so they must be preloaded before it.
_WHEEL_DEPS = ("libquadmath-", "libgfortran-", "libgomp-")
# MKL's threaded layers, and OpenBLAS's OpenMP build (`libopenblaso`) with more than one thread,
# ran far slower here than single-threaded (docs/results/blas).
_MKL_ENV = (("MKL_THREADING_LAYER", "SEQUENTIAL"),)
_OPENMP_ENV = (("OMP_NUM_THREADS", "1"),)
PIP_HINT = "pip install faiss-cpu"
APT_HINT = "apt install libopenblas0-pthread"
OPT_OUT = "DFLASH2_NO_OPENBLAS"
OVERRIDE = "DFLASH2_OPENBLAS"
IGNORE_SYSTEM = "DFLASH2_BLAS_IGNORE_SYSTEM"
_MARK = "DFLASH2_BLAS_REEXEC"
_FAST_BLAS = ("libopenblas", "libmkl_rt", "libblis", "libflexiblas")


@dataclass(frozen=True)
class FastBlas:
    """A fast BLAS to preload: `preload` lists it last, after the libraries it needs first."""

    name: str
    preload: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    source: str

    @property
    def library(self) -> str:
        return self.preload[-1]

    def to_json(self) -> dict:
        return {"name": self.name, "library": self.library, "preload": list(self.preload),
                "env": dict(self.env), "source": self.source}


def blas_from_path(path: str, source: str) -> FastBlas:
    """The preload recipe for one library file: its bundled runtime deps and the env it needs."""
    lib = Path(path)
    if lib.name.startswith("libmkl_rt"):
        return FastBlas("mkl", (path,), _MKL_ENV, source)
    deps = []
    if lib.parent.name.endswith(".libs"):
        for stem in _WHEEL_DEPS:
            deps += sorted(str(p) for p in lib.parent.glob(f"{stem}*.so*"))[:1]
    return FastBlas("openblas", (*deps, path), _OPENMP_ENV if lib.name.startswith("libopenblaso") else (), source)


def pip_roots() -> dict[str, list[Path]]:
    """Folders pip installs into: site-packages ("site") and the prefixes' lib/ ("data")."""
    sites = [*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"]]
    data = [Path(sysconfig.get_paths()["data"]) / "lib", Path(site.getuserbase()) / "lib"]
    return {"site": list(dict.fromkeys(Path(p) for p in sites)), "data": list(dict.fromkeys(data))}


def _find_in(roots: dict[str, list[Path]], kind: str, pattern: str) -> FastBlas | None:
    for root in roots.get(kind, []):
        found = sorted(root.glob(pattern)) if root.is_dir() else []
        if found:
            return blas_from_path(str(found[0]), f"pip ({root})")
    return None


def find_pip_blas(roots: dict[str, list[Path]] | None = None) -> FastBlas | None:
    """The pip-installed fast BLAS under `roots` (default: this interpreter's): MKL, else faiss-cpu's."""
    roots = pip_roots() if roots is None else roots
    return _find_in(roots, *PIP_MKL) or _find_in(roots, *PIP_OPENBLAS)


def find_fast_blas(environ=None, roots=None) -> FastBlas | None:
    """The fast BLAS to preload: `$DFLASH2_OPENBLAS`, else pip's MKL, the system OpenBLAS, pip's OpenBLAS."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE)
    if override:
        return blas_from_path(override, OVERRIDE) if os.path.exists(override) else None
    roots = pip_roots() if roots is None else roots
    mkl = _find_in(roots, *PIP_MKL)
    if mkl:
        return mkl
    if env.get(IGNORE_SYSTEM) != "1":
        system = next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)
        if system:
            return blas_from_path(system, "system")
    return _find_in(roots, *PIP_OPENBLAS)


def bundled_reference_blas() -> Path | None:
    """The reference BLAS shipped in the mlx-cpu wheel (`mlx_cpu.libs/libblas-*.so*`), found without importing mlx."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        libs = Path(location).parent / "mlx_cpu.libs"
        found = sorted(libs.glob("libblas*.so*")) if libs.is_dir() else []
        if found:
            return found[0]
    return None


def preloaded_fast_blas(environ=None) -> bool:
    env = os.environ if environ is None else environ
    names = [Path(p).name for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    return any(n.startswith(_FAST_BLAS) for n in names)


def _mapped_libraries() -> list[str]:
    """Shared libraries mapped into this process (Linux), e.g. to see which BLAS MLX uses."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in lines if ".so" in line.split()[-1]})


def active_blas() -> dict:
    """Which BLAS MLX's CPU backend calls in this process.

    A preloaded fast BLAS wins symbol lookup over the wheel's bundled one, so its presence in
    the process decides. Meaningful after `import mlx.core`.
    """
    if sys.platform == "darwin":
        return {"name": "accelerate", "library": "Accelerate.framework", "fast": True}
    libs = _mapped_libraries()
    fast = [lib for lib in libs if Path(lib).name.startswith(_FAST_BLAS)]
    if fast:
        prefix = next(p for p in _FAST_BLAS if Path(fast[0]).name.startswith(p))
        return {"name": prefix.removeprefix("lib").removesuffix("_rt"), "library": fast[0], "fast": True}
    reference = [lib for lib in libs if "mlx_cpu.libs" in lib and Path(lib).name.startswith("libblas")]
    if reference:
        return {"name": "reference", "library": reference[0], "fast": False}
    return {"name": "unknown", "library": None, "fast": None}


def should_reexec(environ=None, platform: str | None = None) -> tuple[bool, str]:
    """Whether the CLI re-executes itself with a fast BLAS preloaded, and why (or why not)."""
    env = os.environ if environ is None else environ
    if not (platform or sys.platform).startswith("linux"):
        return False, "not Linux (Accelerate/Metal on macOS)"
    if env.get(OPT_OUT) == "1":
        return False, f"disabled by {OPT_OUT}=1"
    if env.get(_MARK):
        return False, "already re-executed with a fast BLAS preloaded"
    if preloaded_fast_blas(env):
        return False, "a fast BLAS is already preloaded"
    if bundled_reference_blas() is None:
        return False, "MLX does not use the wheel's bundled reference BLAS"
    found = find_fast_blas(env)
    if found is None:
        return False, f"no fast BLAS found ({APT_HINT} or {PIP_HINT})"
    return True, f"preloading {found.library} ({found.source})"


def reexec_env(found: FastBlas, environ=None) -> dict:
    """The environment of the re-executed CLI: `found` preloaded, its settings unless already set."""
    env = dict(os.environ if environ is None else environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [*found.preload, env.get("LD_PRELOAD")]))
    for key, value in found.env:
        env.setdefault(key, value)
    env[_MARK] = "1"
    return env


def _advice(active: dict, found: FastBlas | None) -> str:
    if active["fast"]:
        return "fast BLAS in use"
    if not sys.platform.startswith("linux"):
        return "nothing to do"
    if found is None:
        return f"install a fast BLAS: {APT_HINT} (or {PIP_HINT}); dflash2 then preloads it"
    settings = "".join(f" {k}={v}" for k, v in found.env)
    if os.environ.get(OPT_OUT) == "1":
        return f"unset {OPT_OUT} so dflash2 preloads {found.library}"
    return (f"run through the `dflash2` command (it preloads {found.library} automatically) or set"
            f"{settings} LD_PRELOAD={':'.join(found.preload)}")


def describe() -> dict:
    """The BLAS facts `dflash2 doctor` prints, with advice."""
    active = active_blas()
    reexec, why = should_reexec()
    found = find_fast_blas()
    return {"active": active, "bundled_reference": str(bundled_reference_blas() or "") or None,
            "found": found.to_json() if found else None, "openblas": found.library if found else None,
            "preloaded": preloaded_fast_blas(), "cli_reexec": why, "would_reexec": reexec,
            "opt_out": f"{OPT_OUT}=1", "advice": _advice(active, found)}


def slow_blas_warning() -> str | None:
    """One line saying the reference BLAS is in use, what it costs and the fix; None when fast."""
    active = active_blas()
    if active["fast"] is not False:
        return None
    return (f"warning: MLX is using the slow reference BLAS (on 2 CPU cores the demo decodes 1.5 instead of "
            f"8 tok/s, prompts ~18x slower); fix: {_advice(active, find_fast_blas())}")


def maybe_reexec_with_openblas() -> None:
    reexec, _ = should_reexec()
    if not reexec:
        return
    env = reexec_env(find_fast_blas())
    os.execve(sys.executable, [sys.executable, "-m", "dflash2_mlx", *sys.argv[1:]], env)
