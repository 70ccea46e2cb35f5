"""Linux: MLX's CPU wheel bundles a slow reference BLAS; preload the system OpenBLAS.

The `mlx-cpu` wheel ships netlib's reference `libblas` in `mlx_cpu.libs/`. Preloading OpenBLAS
(`LD_PRELOAD`) interposes its `sgemm` & co.: a width-8 verify pass then costs about 1.8x one
token instead of 7.5x, and prefill runs about 10x faster. The CLI re-executes itself once with OpenBLAS preloaded when:
Linux, the bundled reference BLAS is present, an OpenBLAS library exists, nothing is
preloaded yet, and `DFLASH2_NO_OPENBLAS` is not `1`. `DFLASH2_OPENBLAS=/path/libopenblas.so`
picks the library. `describe()` reports what this process actually uses (for `doctor`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
OPT_OUT = "DFLASH2_NO_OPENBLAS"
OVERRIDE = "DFLASH2_OPENBLAS"
_MARK = "DFLASH2_BLAS_REEXEC"
_FAST_BLAS = ("libopenblas", "libmkl_rt", "libblis", "libflexiblas")


def find_openblas() -> str | None:
    """The OpenBLAS to preload: `$DFLASH2_OPENBLAS`, else the first system library found."""
    override = os.environ.get(OVERRIDE)
    if override:
        return override if os.path.exists(override) else None
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


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


def preloaded_openblas() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


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
    """Whether the CLI re-executes itself with OpenBLAS preloaded, and why (or why not)."""
    env = os.environ if environ is None else environ
    if not (platform or sys.platform).startswith("linux"):
        return False, "not Linux (Accelerate/Metal on macOS)"
    if env.get(OPT_OUT) == "1":
        return False, f"disabled by {OPT_OUT}=1"
    if "openblas" in env.get("LD_PRELOAD", "") or env.get(_MARK):
        return False, "OpenBLAS is already preloaded"
    if bundled_reference_blas() is None:
        return False, "MLX does not use the wheel's bundled reference BLAS"
    if find_openblas() is None:
        return False, "no OpenBLAS found (apt install libopenblas0-pthread)"
    return True, f"preloading {find_openblas()}"


def describe() -> dict:
    """The BLAS facts `dflash2 doctor` prints, with advice."""
    active = active_blas()
    reexec, why = should_reexec()
    openblas = find_openblas()
    if active["fast"]:
        advice = "fast BLAS in use"
    elif sys.platform.startswith("linux") and openblas:
        advice = (f"run through the `dflash2` command (it preloads {openblas} automatically) or set "
                  f"LD_PRELOAD={openblas}")
    elif sys.platform.startswith("linux"):
        advice = "install OpenBLAS (Debian/Ubuntu: apt install libopenblas0-pthread); dflash2 then preloads it"
    else:
        advice = "nothing to do"
    return {"active": active, "bundled_reference": str(bundled_reference_blas() or "") or None,
            "openblas": openblas, "preloaded": preloaded_openblas(), "cli_reexec": why, "would_reexec": reexec,
            "opt_out": f"{OPT_OUT}=1", "advice": advice}


def maybe_reexec_with_openblas() -> None:
    reexec, _ = should_reexec()
    if not reexec:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [find_openblas(), env.get("LD_PRELOAD")]))
    env[_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "dflash2_mlx", *sys.argv[1:]], env)
