"""Speculation statistics from a cycle log, in one place for the engine, bench, diagnose, the CLI
and the server.

A cycle is anything with `n_drafted` and `n_accepted` (the engine's `CycleStats`); a plain
decoding step drafts nothing and is left out of every figure here.

* τ (tokens per speculative cycle, bonus included): `(accepted + cycles) / cycles`, in
  [1, block size]; 1.0 when nothing was drafted (`tau`), or None where "no data" must show.
* acceptance by position i = 1..depth: P(draft i accepted | drafts 1..i-1 accepted), pooled
  over cycles that drafted at least i tokens (the DFlash blog's Figure 5).
"""

from __future__ import annotations

from typing import Iterable


def speculative(cycles: Iterable) -> list:
    """The cycles that drafted something."""
    return [c for c in cycles if c.n_drafted > 0]


def tau_from_counts(n_accepted: int, n_cycles: int) -> float:
    """τ from totals: accepted drafts over `n_cycles` speculative cycles (1.0 when none)."""
    return (n_accepted + n_cycles) / n_cycles if n_cycles else 1.0


def tau(cycles: Iterable, empty: float | None = 1.0) -> float | None:
    """τ of a cycle log; `empty` when it holds no speculative cycle."""
    spec = speculative(cycles)
    return tau_from_counts(sum(c.n_accepted for c in spec), len(spec)) if spec else empty


def acceptance_counts(cycles: Iterable) -> list[tuple[int, int]]:
    """(accepted, reached) per block position i = 1..max drafted: position i is reached when at
    least i drafts were proposed and the i - 1 before it were accepted."""
    spec = speculative(cycles)
    depth = max((c.n_drafted for c in spec), default=0)
    out = []
    for i in range(depth):
        reached = [c for c in spec if c.n_drafted > i and c.n_accepted >= i]
        out.append((sum(c.n_accepted > i for c in reached), len(reached)))
    return out


def rates(counts: list[tuple[int, int]]) -> list[float | None]:
    """accepted / reached per position; None where a position was never reached."""
    return [a / r if r else None for a, r in counts]


def acceptance_by_position(cycles: Iterable) -> list[float]:
    """Conditional acceptance per position (0.0 where never reached)."""
    return [a / r if r else 0.0 for a, r in acceptance_counts(cycles)]


def accepted_histogram(cycles: Iterable) -> list[int]:
    """Speculative cycles by number of accepted drafts (index = n accepted)."""
    spec = speculative(cycles)
    hist = [0] * (max((c.n_drafted for c in spec), default=0) + 1)
    for c in spec:
        hist[c.n_accepted] += 1
    return hist
