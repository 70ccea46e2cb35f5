"""How fast can this machine regenerate answers with the target (on-policy training data)?

mlx-lm's `BatchGenerator` on the demo target, greedy, short chat prompts, at a few batch sizes:
tokens per second including prefill, and the steady decode step time. Prints a table, writes JSON.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python docs/results/drafter-training/batch_generate.py --batch 16,64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time


def measure(target, batch: int, max_tokens: int) -> dict:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me fact number {i} about the ocean."}],
                                       add_generation_prompt=True) for i in range(batch)]
    gen = BatchGenerator(target.model, stop_tokens=[[t] for t in target.eos_token_ids], sampler=make_sampler(0.0),
                         completion_batch_size=batch, prefill_batch_size=min(8, batch))
    gen.insert(prompts, max_tokens=[max_tokens] * batch)
    n, steps, step_times, done = 0, 0, [], set()
    t0 = last = time.perf_counter()
    while len(done) < batch:
        _, responses = gen.next()
        now = time.perf_counter()
        if len(responses) == batch:  # a full decode step: every row produced a token
            step_times.append(now - last)
        last = now
        n += len(responses)
        done.update(r.uid for r in responses if r.finish_reason is not None)
        steps += 1
    wall = time.perf_counter() - t0
    step_times.sort()
    step = step_times[len(step_times) // 2] if step_times else None
    return {"batch": batch, "tokens": n, "wall_s": wall, "tok_s": n / wall, "median_full_step_s": step,
            "steady_tok_s": batch / step if step else None}


def main() -> None:
    from dflash2_mlx import load_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--batch", default="16,64", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = load_target(args.model)
    rows = [measure(target, int(b), args.max_tokens) for b in args.batch.split(",")]
    print("| batch | tok/s (prefill included) | median full decode step | steady tok/s |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        step = "–" if r["median_full_step_s"] is None else f"{r['median_full_step_s']:.3f} s"
        steady = "–" if r["steady_tok_s"] is None else f"{r['steady_tok_s']:.0f}"
        print(f"| {r['batch']} | {r['tok_s']:.1f} | {step} | {steady} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
