"""Replay recorded acceptance through width policies (pure Python, seconds to run).

A bench JSON's fixed-width-4 runs give, for each reply, how many drafts were accepted from
each cycle's start; a width-w cycle from the same position accepts min(that, w - 1) (an
approximation: a narrower block drafts a little differently). Cycle times are the ones the
bench measured. `auto` is the shipped policy, told when each reply begins; `auto, no begin`
is the policy before it was (what one reply's poor drafts did to the next ones). A synthetic
useless drafter (acceptance 0 and 0.1 per position) shows the cost of probing.

    python docs/results/width-policy/replay.py docs/results/width-policy/bench_before.json.gz
"""
import gzip
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from dflash2_mlx.core import block_policy as bp  # noqa: E402
from dflash2_mlx.core.events import CycleStats  # noqa: E402

SECONDS = {1: 0.074, 2: 0.088, 3: 0.096, 4: 0.103}  # cycle times of bench_v4's fixed-width runs
CALIBRATED = bp.Costs((0.0709, 0.0776, 0.0859, 0.0941), (0.0, 0.0113, 0.0113, 0.0113))  # its calibration
DRAFT_S = 0.0113


def replies(path):
    """(suite, accepted-from-position map, reply length, accepted counts at cycle starts) per reply."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    for run in json.load(opener(path, "rt"))["runs"]:
        if run["mode"] != "dflash2@4":
            continue
        accepted, pos, starts = {}, 0, []
        for width, _, n_acc, *_ in run["cycles"]:
            if width < 4:
                break
            for k in range(n_acc + 1):  # from the rejected position the drafter's answer is unknown
                accepted[pos + k] = n_acc - k if k < n_acc or k == 0 else None
            starts.append(n_acc)
            pos += n_acc + 1
        out.append((run["suite"], accepted, pos, starts))
    return out


def speedup(make_policy, reps, seed, tell_begin):
    """Tokens per second over plain decoding's, by suite and overall."""
    rng, policy, by_suite = random.Random(seed), make_policy(), {}
    for suite, accepted, n, starts in reps:
        if tell_begin:
            policy.begin()
        pos, seconds = 0, 0.0
        while pos < n:
            w = min(policy.next_width(4), 4)
            if w == 1:
                cycle, pos = CycleStats(1, 0, 0, 1, 0.0, SECONDS[1]), pos + 1
            else:
                a = accepted.get(pos)
                a = min(rng.choice(starts) if a is None else a, w - 1)
                cycle, pos = CycleStats(w, w - 1, a, a + 1, DRAFT_S, SECONDS[w] - DRAFT_S), pos + a + 1
            seconds += SECONDS[w]
            policy.observe(cycle)
        s = by_suite.setdefault(suite, [0, 0.0])
        s[0], s[1] = s[0] + n, s[1] + seconds
    total = sum(v[0] for v in by_suite.values()) / sum(v[1] for v in by_suite.values())
    return {k: v[0] / v[1] * SECONDS[1] for k, v in by_suite.items()}, total * SECONDS[1]


def synthetic(p, n_replies=15, n_tokens=96, seed=0):
    rng, out = random.Random(seed), []
    for _ in range(n_replies):
        starts = []
        for _ in range(200):
            a = 0
            while a < 3 and rng.random() < p:
                a += 1
            starts.append(a)
        out.append((f"acceptance {p}", {}, n_tokens, starts))
    return out


ARMS = {
    "width 2": (lambda: bp.FixedBlockPolicy(2), False),
    "width 3": (lambda: bp.FixedBlockPolicy(3), False),
    "width 4": (lambda: bp.FixedBlockPolicy(4), False),
    "auto, no begin": (lambda: bp.AdaptiveBlockPolicy(CALIBRATED), False),
    "auto": (lambda: bp.AdaptiveBlockPolicy(CALIBRATED), True),
}


def table(reps, seeds=20):
    rows = {}
    for name, (make, begin) in ARMS.items():
        runs = [speedup(make, reps, s, begin) for s in range(seeds)]
        rows[name] = {"all": statistics.mean(r[1] for r in runs),
                      **{k: statistics.mean(r[0][k] for r in runs) for k in runs[0][0]}}
    return rows


if __name__ == "__main__":
    out = {"recorded": table(replies(sys.argv[1]))}
    for p in (0.0, 0.1):
        out[f"useless {p}"] = table(synthetic(p), seeds=10)
    for part, rows in out.items():
        cols = list(next(iter(rows.values())))
        print(f"\n{part}: speedup over plain decoding (mean of seeds)")
        print(f"{'policy':16s}" + "".join(f"{c:>16s}" for c in cols))
        for name, row in rows.items():
            print(f"{name:16s}" + "".join(f"{row[c]:16.3f}" for c in cols))
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
