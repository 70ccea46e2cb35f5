"""Time SmolLM2-135M forwards under each BLAS option, each in its own process.

Usage: python measure_blas.py --rounds 5 [--only NAME ...] > raw.jsonl
       python measure_blas.py --summarize raw.jsonl
       python measure_blas.py --summarize-demo demo.jsonl   (the output of measure_demo.sh)

Each child loads the demo target, then times a 128-token prefill and width-1 / width-8 forwards
after that prompt (rolled back to one token each time, as the engine does). Options run in an
order that rotates every round, so drift on this shared CPU spreads evenly; the summary takes
medians over rounds. Library paths come from the environment variables below (unset: skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SYSTEM_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
MKL_RT = os.environ.get("MKL_RT", "")  # .../lib/libmkl_rt.so.3 of an installed `mkl` wheel
IOMP_DIR = os.environ.get("IOMP_DIR", "")  # .../lib of `intel-openmp` (for MKL's INTEL layer)
CVXOPT_LIBS = os.environ.get("CVXOPT_LIBS", "")  # .../cvxopt.libs of an installed `cvxopt` wheel
FAISS_LIBS = os.environ.get("FAISS_LIBS", "")  # .../faiss_cpu.libs of an installed `faiss-cpu` wheel
NGSOLVE_OPENBLAS = os.environ.get("NGSOLVE_OPENBLAS", "")  # ngsolve_openblas/libopenblasp-r0.3.33.so


def _glob_one(folder: str, pattern: str) -> str:
    import glob

    found = sorted(glob.glob(os.path.join(folder, pattern)))
    return found[0] if found else ""


def options() -> dict[str, dict]:
    """Name -> extra environment for the child (LD_PRELOAD and friends)."""
    opts = {"reference": {}}
    if os.path.exists(SYSTEM_OPENBLAS):
        opts["system-openblas"] = {"LD_PRELOAD": SYSTEM_OPENBLAS}
        opts["system-openblas-1t"] = {"LD_PRELOAD": SYSTEM_OPENBLAS, "OPENBLAS_NUM_THREADS": "1"}
    if MKL_RT:
        opts["mkl-sequential"] = {"LD_PRELOAD": MKL_RT, "MKL_THREADING_LAYER": "SEQUENTIAL"}
        opts["mkl-gnu"] = {"LD_PRELOAD": MKL_RT, "MKL_THREADING_LAYER": "GNU"}
        if IOMP_DIR:
            opts["mkl-intel"] = {"LD_PRELOAD": MKL_RT, "MKL_THREADING_LAYER": "INTEL", "LD_LIBRARY_PATH": IOMP_DIR}
    if CVXOPT_LIBS:
        chain = [_glob_one(CVXOPT_LIBS, p) for p in ("libquadmath-*", "libgfortran-*", "libopenblas-*")]
        opts["cvxopt-openblas"] = {"LD_PRELOAD": ":".join(chain)}
    if FAISS_LIBS:
        chain = [_glob_one(FAISS_LIBS, p) for p in ("libquadmath-*", "libgfortran-*", "libgomp-*", "libopenblas*")]
        opts["faiss-openblas"] = {"LD_PRELOAD": ":".join(chain), "OMP_NUM_THREADS": "1"}  # else ~10x slower
    if NGSOLVE_OPENBLAS:
        opts["ngsolve-openblas"] = {"LD_PRELOAD": NGSOLVE_OPENBLAS}
    return opts


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats)) * 1e3


def child() -> None:
    import mlx.core as mx
    import numpy as np

    from dflash2_mlx import hub
    from dflash2_mlx.blas import active_blas
    from dflash2_mlx.target import load_target

    target = load_target(hub.resolve(None, None, progress=False).target)
    ids = mx.array(np.random.default_rng(0).integers(3, target.info.vocab_size, size=(1, 136)), dtype=mx.int32)

    def prefill() -> float:
        cache = target.make_cache(reserve=8)
        t0 = time.perf_counter()
        mx.eval(target.forward(ids[:, :128], cache, (), "last")[0])
        return time.perf_counter() - t0

    cache = target.make_cache(reserve=8)
    mx.eval(target.forward(ids[:, :128], cache, (), "last")[0])

    def step(width: int) -> float:
        target.arm(cache)
        t0 = time.perf_counter()
        logits, _ = target.forward(ids[:, 128:128 + width], cache, (), "all" if width > 1 else "last")
        mx.eval(mx.argmax(logits, axis=-1))
        seconds = time.perf_counter() - t0
        target.commit(cache, n_fed=width, n_keep=1)  # keeps one token: the context grows as in decoding
        return seconds

    step(1), step(8), prefill()  # warm shapes
    out = {"w1_ms": _median_ms(lambda: step(1), 9), "w8_ms": _median_ms(lambda: step(8), 9),
           "prefill_ms": _median_ms(prefill, 3), "blas": active_blas()["library"]}
    print(json.dumps(out))


def parent(rounds: int, only: list[str]) -> None:
    opts = {k: v for k, v in options().items() if not only or k in only}
    names = list(opts)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            done = subprocess.run([sys.executable, __file__, "--child"], env={**base, **opts[name]},
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(json.dumps({"option": name, "round": r, "error": done.stderr.strip()[-300:]}), flush=True)
                continue
            print(json.dumps({"option": name, "round": r, **json.loads(done.stdout.splitlines()[-1])}), flush=True)


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ok = [r for r in rows if "error" not in r]
    names = list(dict.fromkeys(r["option"] for r in ok))
    med = {n: {k: statistics.median(r[k] for r in ok if r["option"] == n) for k in ("w1_ms", "w8_ms", "prefill_ms")}
           for n in names}
    ref = med.get("system-openblas")
    print(f"{'option':20s} {'rounds':>6s} {'w1 ms':>8s} {'w8 ms':>8s} {'prefill ms':>11s}  "
          "ratio to system OpenBLAS (w1/w8/prefill)")
    for n in names:
        m, k = med[n], sum(r["option"] == n for r in ok)
        ratio = "/".join(f"{m[x] / ref[x]:.2f}" for x in m) if ref else "-"
        print(f"{n:20s} {k:6d} {m['w1_ms']:8.1f} {m['w8_ms']:8.1f} {m['prefill_ms']:11.1f}  {ratio}")
    for r in rows:
        if "error" in r:
            print(f"error {r['option']} round {r['round']}: {r['error']}")


def summarize_demo(path: str) -> None:
    """Medians of `measure_demo.sh` output: speculative and plain tok/s, prompt tok/s."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print(f"{'option':20s} {'spec tok/s':>10s} {'plain tok/s':>11s} {'spec/plain':>10s} {'prompt tok/s':>12s}")
    for name in dict.fromkeys(r["option"] for r in rows):
        mine = [r for r in rows if r["option"] == name]
        spec = statistics.median(r["decode_tps"] for r in mine if r["drafter"] == "default")
        plain = statistics.median(r["decode_tps"] for r in mine if r["drafter"] == "none")
        prompt = statistics.median(r["prompt_tps"] for r in mine)
        print(f"{name:20s} {spec:10.1f} {plain:11.1f} {spec / plain:10.2f} {prompt:12.0f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--summarize")
    ap.add_argument("--summarize-demo")
    a = ap.parse_args()
    if a.child:
        child()
    elif a.summarize or a.summarize_demo:
        summarize(a.summarize) if a.summarize else summarize_demo(a.summarize_demo)
    else:
        parent(a.rounds, a.only)
