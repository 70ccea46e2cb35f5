"""Prefill time of one long prompt: `mlx_lm.stream_generate` against ours (plain), interleaved,
in one process, on the demo target (issue 26).

    python docs/results/long-context/prefill_vs_mlx_lm.py 4096

The prompt is `dflash2 bench --context N`'s (package sources + a question, chat template); each
side generates one token, so the time is the prefill. Like the CLI, it runs with the fast BLAS
the project finds preloaded (re-executing itself once), else MLX's reference BLAS is timed.
"""

import os
import sys
import time

from dflash2_mlx.blas import find_fast_blas, reexec_env, should_reexec

if should_reexec()[0] and (found := find_fast_blas()) is not None:
    os.execve(sys.executable, [sys.executable, *sys.argv], reexec_env(found))

import mlx_lm  # noqa: E402

from dflash2_mlx.bench import default_encoder  # noqa: E402
from dflash2_mlx.long_context import context_suite  # noqa: E402
from dflash2_mlx.session import Session  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    session = Session.open("smollm2-demo", drafter="none", progress=False)
    target = session.target
    encode = default_encoder(target)
    ids = encode(context_suite(target.tokenizer, encode, n, 1).prompts[0])
    print("prompt tokens", len(ids), flush=True)

    def ours():
        for _ in session.stream(ids, max_tokens=1):
            pass

    def reference():
        for _ in mlx_lm.stream_generate(target.model, target.tokenizer, ids, max_tokens=1):
            pass

    for name, run in [("mlx_lm", reference), ("ours", ours)] * 2:
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        print(f"{name} {dt:.1f}s {len(ids) / dt:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
