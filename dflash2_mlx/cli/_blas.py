"""Linux: MLX's CPU wheel bundles a slow reference BLAS; preload the system OpenBLAS.

The CLI re-executes itself once with `LD_PRELOAD` pointing at OpenBLAS when that library
exists and nothing is preloaded yet. Opt out with `DFLASH2_NO_OPENBLAS=1`.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_MARK = "DFLASH2_BLAS_REEXEC"


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def preloaded_openblas() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def maybe_reexec_with_openblas() -> None:
    if not sys.platform.startswith("linux") or os.environ.get("DFLASH2_NO_OPENBLAS") == "1":
        return
    if preloaded_openblas() or os.environ.get(_MARK):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env[_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "dflash2_mlx", *sys.argv[1:]], env)
