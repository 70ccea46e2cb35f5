"""Block size (verify width) from measured costs and acceptance: never slower than plain decoding.

A cycle of width w costs `cycle_s[w]` seconds (target forward of w tokens + one drafter call;
w = 1 is a plain decoding step) and emits on average

    E[tokens | w] = 1 + sum_{k=1}^{w-1} prod_{i<=k} a_i

tokens, where a_i is the conditional acceptance of block position i (accepted given the drafts
before it were). The policy picks the width with the most expected tokens per second, and
decodes plainly (width 1) whenever no speculative width is predicted to beat it.

The decision part is pure Python (no mlx): `choose_width` over `Costs` and an acceptance
curve, `AcceptanceEstimate` (decayed counts, unseen positions inherit their predecessor), and
`AdaptiveBlockPolicy`, the object the engine calls (`next_width`, `observe`). Costs come from a
per-machine, per-model calibration (`calibration.py` measures them; this module caches them
as JSON under the user cache dir) plus per-cycle overheads learned from the times the engine
reports, so context growth and machine load move the choice too.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ..paths import atomic_path

DEFAULT_HYSTERESIS = 0.05  # a new width must be predicted this much faster to replace the current one
DEFAULT_DECAY = 0.97  # per speculative cycle: acceptance evidence fades over ~30 cycles
DEFAULT_PRIOR_ACCEPTANCE = 0.6
DEFAULT_PRIOR_WEIGHT = 2.0  # pseudo-observations behind each position's prior
DEFAULT_PROBE_EVERY = 32  # plain steps before the first speculative probe while speculation is off
MAX_PROBE_EVERY = 1024  # failed probes double the gap up to this
# A failed probe's measured loss (in plain steps) sets the least gap before the next one, so that
# failed probes cost at most this share of plain decoding time (a width-4 verify at 8k tokens of
# quantized K/V costs ~1.8 plain steps on a CPU).
PROBE_BUDGET = 0.02
DEFAULT_COST_EMA = 0.1
FAST_COST_EMA = 0.5  # for a cycle over twice the predicted cost
# Acceptance belongs to the text: a new reply keeps half the evidence and, when decoding plainly,
# probes at once, so one reply's poor drafts do not keep speculation off in the next ones.
REPLY_FADE = 0.5
CALIBRATION_SCHEMA = 2  # 2: slope_s, the costs measured again at a longer context



# -- costs and the expected rate --------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """Measured seconds, indexed by width - 1 (index 0 = a plain decoding step).

    target_s[w-1]: one target forward of w tokens (logits + argmax, taps included);
    draft_s[w-1]:  one drafter call proposing w - 1 tokens (0 for w = 1);
    slope_s[w-1]:  seconds that forward gains per token of context (measured at two contexts;
                   empty when not measured).
    """

    target_s: tuple[float, ...]
    draft_s: tuple[float, ...]
    slope_s: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.target_s or len(self.target_s) != len(self.draft_s):
            raise ValueError(f"target_s ({len(self.target_s)}) and draft_s ({len(self.draft_s)}) "
                             "must be non-empty and of equal length")
        if any(not s > 0 for s in self.target_s) or any(s < 0 for s in self.draft_s):
            raise ValueError(f"costs must be positive, got target_s={self.target_s} draft_s={self.draft_s}")
        if self.slope_s and (len(self.slope_s) != len(self.target_s) or any(s < 0 for s in self.slope_s)):
            raise ValueError(f"slope_s must be empty or {len(self.target_s)} non-negative values, got {self.slope_s}")

    @property
    def max_width(self) -> int:
        return len(self.target_s)

    def cycle_s(self, width: int) -> float:
        return self.target_s[width - 1] + self.draft_s[width - 1]

    def growth(self, width: int) -> float:
        """How many times faster a width-`width` forward's cost grows with the context than a
        plain step's: the measured slopes' ratio (on a CPU each verified row reads the context
        again), else the calibrated cost ratio; within [1, width], so noise in a flat slope
        stays bounded."""
        if self.slope_s and self.slope_s[0] > 0:
            ratio = self.slope_s[width - 1] / self.slope_s[0]
        else:
            ratio = self.target_s[width - 1] / self.target_s[0]
        return min(max(ratio, 1.0), float(width))


def nondecreasing(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators).

    A forward over more tokens does not cost less; measured dips are timing noise, so the
    calibration smooths them away instead of letting the policy chase them.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


def expected_tokens(acceptance: Sequence[float], width: int) -> float:
    """Mean tokens emitted by a cycle of `width` (bonus included) under conditional acceptance."""
    total, survive = 1.0, 1.0
    for k in range(width - 1):
        survive *= acceptance[k] if k < len(acceptance) else (acceptance[-1] if acceptance else 0.0)
        total += survive
    return total


def expected_rates(costs: Costs, acceptance: Sequence[float], max_width: int,
                   plain_overhead_s: float = 0.0, spec_overhead_s: float = 0.0) -> list[float]:
    """Predicted tokens/s for widths 1..max_width (index = width - 1).

    The overheads are per-cycle seconds the engine spends beyond the calibrated forward
    passes (host work, syncs, attention over a longer context), learned online; a cycle never
    costs less than half its calibrated time.
    """
    rates = []
    for w in range(1, min(max_width, costs.max_width) + 1):
        base = costs.cycle_s(w)
        extra = plain_overhead_s if w == 1 else spec_overhead(costs, w, plain_overhead_s, spec_overhead_s)
        seconds = max(base + extra, base / 2)
        rates.append(expected_tokens(acceptance, w) / seconds)
    return rates


def spec_overhead(costs: Costs, width: int, plain_overhead_s: float, spec_overhead_s: float) -> float:
    """A speculative cycle's overhead in seconds: the learned one (per unit of `Costs.growth`),
    but at least the plain step's, scaled by the width's growth. Plain steps measure the cost of
    a grown context on every step, speculative cycles only while speculating; a wider forward
    over it costs no less, and at long context on a CPU each verified row pays it again."""
    return max(spec_overhead_s, plain_overhead_s) * costs.growth(width)


def break_even_acceptance(costs: Costs, width: int) -> float | None:
    """The constant per-position acceptance at which `width` matches plain decoding's rate.

    None when even perfect drafts lose at this width (bisection; E[tokens] rises with a).
    """
    plain = 1.0 / costs.cycle_s(1)
    if width / costs.cycle_s(width) <= plain:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid], width) / costs.cycle_s(width) < plain else (lo, mid)
    return hi


@dataclass(frozen=True)
class BlockChoice:
    """A width (1 = plain decoding) with its predicted rate and the plain rate it must beat."""

    width: int
    rate: float
    plain_rate: float

    @property
    def speculate(self) -> bool:
        return self.width >= 2

    @property
    def predicted_speedup(self) -> float:
        return self.rate / self.plain_rate


def choose_width(rates: Sequence[float], current: int | None = None,
                 hysteresis: float = DEFAULT_HYSTERESIS) -> BlockChoice:
    """The width to use next, given predicted rates for widths 1..len(rates).

    Speculation must be predicted faster than plain decoding; switching into it, or between
    speculative widths, needs a margin of `hysteresis` (so estimates that wobble do not make
    the width flap). Leaving speculation needs no margin: a speculative width predicted
    slower than plain decoding is dropped at once ("never slower than AR").
    """
    plain = rates[0]
    best = max(range(1, len(rates) + 1), key=lambda w: (rates[w - 1], -w))
    cur = current if current is not None and 1 <= current <= len(rates) else None
    if cur is not None and cur >= 2 and rates[cur - 1] < plain:
        cur = 1
    if best == 1 or rates[best - 1] <= plain:
        return BlockChoice(1, plain, plain)
    if cur is None:
        return BlockChoice(best, rates[best - 1], plain)
    if best != cur and rates[best - 1] > rates[cur - 1] * (1 + hysteresis):
        return BlockChoice(best, rates[best - 1], plain)
    return BlockChoice(cur, rates[cur - 1], plain)


# -- the running acceptance estimate ----------------------------------------------------


class AcceptanceEstimate:
    """Per-position conditional acceptance from decayed counts of observed cycles.

    Position i's estimate is (accepted_i + w0 * prior_i) / (reached_i + w0) where prior_i is
    the estimate of position i - 1 (the first position's prior is `prior`): positions never
    reached inherit their predecessor's rate, so longer blocks get tried and then measured.
    """

    def __init__(self, n_positions: int, prior: float = DEFAULT_PRIOR_ACCEPTANCE,
                 prior_weight: float = DEFAULT_PRIOR_WEIGHT, decay: float = DEFAULT_DECAY):
        if not 0 <= prior <= 1:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.accepted = [0.0] * n_positions
        self.reached = [0.0] * n_positions

    def reset(self) -> None:
        """Forget all evidence (the prior alone remains)."""
        self.accepted = [0.0] * len(self.accepted)
        self.reached = [0.0] * len(self.reached)

    def fade(self, factor: float) -> None:
        """Weigh the evidence so far by `factor` (the prior gains in proportion)."""
        self.accepted = [a * factor for a in self.accepted]
        self.reached = [r * factor for r in self.reached]

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.fade(self.decay)
        for i in range(min(n_drafted, len(self.accepted))):
            if n_accepted >= i:  # drafts before position i + 1 were all accepted
                self.reached[i] += 1.0
                self.accepted[i] += 1.0 if n_accepted > i else 0.0

    def rates(self) -> list[float]:
        out, prior = [], self.prior
        for acc, reach in zip(self.accepted, self.reached):
            prior = (acc + self.prior_weight * prior) / (reach + self.prior_weight)
            out.append(prior)
        return out


# -- the policy the engine calls --------------------------------------------------------


@dataclass
class PolicyTrace:
    """What the policy decided, for bench/diagnostics (widths chosen, switches, probes)."""

    widths: list[int] = field(default_factory=list)
    n_switches: int = 0
    n_probes: int = 0


class AdaptiveBlockPolicy:
    """Picks each cycle's width from calibrated costs and the running acceptance estimate.

    Args:
        costs: calibrated `Costs` (widths 1..costs.max_width).
        prior, prior_weight, decay: see `AcceptanceEstimate`.
        hysteresis: see `choose_width`.
        probe_every: while decoding plainly, try one speculative cycle after this many steps
            so a rising acceptance is noticed: a probe that beats plain decoding restarts the
            acceptance estimate from it; one that does not bring speculation back doubles the
            gap (up to MAX_PROBE_EVERY), and the gap is at least its measured loss over
            PROBE_BUDGET. Never probes when even perfect drafts would lose.
        cost_ema: weight of each observed cycle time in the online overhead estimates.
    """

    def __init__(self, costs: Costs, prior: float = DEFAULT_PRIOR_ACCEPTANCE,
                 prior_weight: float = DEFAULT_PRIOR_WEIGHT, decay: float = DEFAULT_DECAY,
                 hysteresis: float = DEFAULT_HYSTERESIS, probe_every: int = DEFAULT_PROBE_EVERY,
                 cost_ema: float = DEFAULT_COST_EMA):
        self.costs = costs
        self.acceptance = AcceptanceEstimate(costs.max_width - 1, prior, prior_weight, decay)
        self.hysteresis, self.probe_every, self.cost_ema = hysteresis, probe_every, cost_ema
        # Seconds beyond the calibrated costs: a plain step's, and a speculative cycle's per unit of
        # its width's `Costs.growth` (so one probe's measure carries over to the other widths).
        self.plain_overhead_s, self.spec_overhead_s = 0.0, 0.0
        self.spec_seen = False  # whether a speculative cycle's time has been observed
        self.current: int | None = None
        self.plain_run = 0
        self.probe_gap = probe_every
        self.probe_min_gap = probe_every  # from the last failed probe's measured loss
        self.probing = False
        self.probe_next = False  # a new reply starting while decoding plainly: probe at once
        self.after_plain = True  # the last cycle was plain (or none yet): the drafter has rows to catch up on
        self.trace = PolicyTrace()

    def begin(self) -> None:
        """A new reply starts: its text is new, so the acceptance evidence counts half and, if
        decoding plainly, the first step probes (`restart_probes`)."""
        self.acceptance.fade(REPLY_FADE)
        self.after_plain = True
        self.restart_probes()

    def restart_probes(self) -> None:
        """The probe gap back at its start, and a probe at the next plain choice (if probing is on
        and the last failed probe's cost allows one this soon)."""
        self.probe_gap = max(self.probe_every, self.probe_min_gap) if self.probe_every else 0
        self.probe_next = bool(self.probe_every) and self.plain_run + 1 >= self.probe_min_gap

    def rates(self, max_width: int) -> list[float]:
        return expected_rates(self.costs, self.acceptance.rates(), max_width, self.plain_overhead_s,
                              self.spec_overhead_s)

    def choice(self, max_width: int) -> BlockChoice:
        return choose_width(self.rates(max_width), self.current, self.hysteresis)

    def can_ever_win(self, max_width: int) -> bool:
        """Whether some width beats plain decoding even if every draft were accepted."""
        perfect = expected_rates(self.costs, [1.0], max_width, self.plain_overhead_s, self.spec_overhead_s)
        return max(perfect[1:], default=0.0) > perfect[0]

    def next_width(self, max_width: int) -> int:
        picked = self.choice(max_width)
        width = picked.width
        due = self.probe_next or (self.probe_gap and self.plain_run + 1 >= self.probe_gap)
        self.probe_next = False
        self.probing = width == 1 and due and max_width >= 2 and self.can_ever_win(max_width)
        if self.probing:
            rates = self.rates(max_width)
            width = max(range(2, len(rates) + 1), key=lambda w: (rates[w - 1], -w))
            self.trace.n_probes += 1
        else:
            if self.current is not None and picked.width != self.current:
                self.trace.n_switches += 1
            # Leaving plain decoding rests on costs predicted, not measured, at this context: learn
            # from its first cycle as from a probe.
            self.probing = self.current == 1 and picked.speculate
            self.current = picked.width
        self.trace.widths.append(width)
        return width

    def observe(self, cycle, rows: list[tuple[int, int]] | None = None) -> None:
        """Learn from a `CycleStats`: acceptance from speculative cycles, overheads from all.
        A batch's cycle passes each row's (drafted, accepted) as `rows`."""
        if cycle.n_drafted > 0:
            self.plain_run = 0
            if self.probing and self._beat_plain(cycle):
                # The text may have changed since the evidence was gathered. One accepted draft
                # is common even at a losing acceptance, so it only weakens the old evidence.
                if cycle.n_accepted >= 2:
                    self.acceptance.reset()
                else:
                    self.acceptance.fade(REPLY_FADE)
            for drafted, accepted in rows or [(cycle.n_drafted, cycle.n_accepted)]:
                self.acceptance.observe(drafted, accepted)
            # A probe is the only fresh evidence of a speculative cycle's cost at this context.
            weight = 1.0 if self.probing else self.cost_ema
            self.spec_overhead_s = self._update_overhead(self.spec_overhead_s, cycle, weight)
            self.spec_seen = True
            if self.probing:
                self._after_probe(cycle)
        else:
            self.plain_run += 1
            self.plain_overhead_s = self._update_overhead(self.plain_overhead_s, cycle)
        self.after_plain = cycle.n_drafted == 0

    def _beat_plain(self, cycle) -> bool:
        """Whether this cycle's tokens came faster than plain decoding's predicted rate."""
        if cycle.width > self.costs.max_width:
            return False
        extra = spec_overhead(self.costs, cycle.width, self.plain_overhead_s, self.spec_overhead_s)
        spec_s = max(self.costs.cycle_s(cycle.width) + extra, self.costs.cycle_s(cycle.width) / 2)
        plain_s = max(self.costs.cycle_s(1) + self.plain_overhead_s, self.costs.cycle_s(1) / 2)
        return (cycle.n_accepted + 1) / spec_s > 1 / plain_s

    def _after_probe(self, cycle) -> None:
        """The next probe's gap: back to the start if speculation resumes, else doubled and at
        least the probe's measured loss (plain steps it cost beyond its tokens) over PROBE_BUDGET."""
        if self.choice(cycle.width).speculate:
            self.probe_gap = self.probe_min_gap = self.probe_every
            return
        plain_s = max(self.costs.cycle_s(1) + self.plain_overhead_s, self.costs.cycle_s(1) / 2)
        lost_steps = (cycle.draft_s + cycle.verify_s) / plain_s - (cycle.n_accepted + 1)
        self.probe_min_gap = min(max(self.probe_every, math.ceil(lost_steps / PROBE_BUDGET)), MAX_PROBE_EVERY)
        self.probe_gap = min(max(2 * self.probe_gap, self.probe_min_gap), MAX_PROBE_EVERY)

    def _update_overhead(self, overhead: float, cycle, weight: float | None = None) -> float:
        """The blended overhead; a speculative one is kept per unit of its width's growth."""
        if not 1 <= cycle.width <= self.costs.max_width:
            return overhead
        base = self.costs.cycle_s(cycle.width)
        scale = self.costs.growth(cycle.width) if cycle.width > 1 else 1.0
        if cycle.width > 1:
            overhead = spec_overhead(self.costs, cycle.width, self.plain_overhead_s, overhead)
        draft_s = cycle.draft_s
        if self.after_plain and cycle.width > 1:  # its drafting caught up on the prompt or plain rows too
            draft_s = min(draft_s, self.costs.draft_s[cycle.width - 1])
        delta = max(draft_s + cycle.verify_s - base, -base / 2)
        if self.after_plain and cycle.width == 1:  # one slow step among plain ones is noise, not a jump
            delta = min(delta, overhead + base)
        weight = self.cost_ema if weight is None else weight
        if delta > 2 * overhead + base:  # a jump (a much longer prompt), not noise: follow it fast
            weight = max(weight, FAST_COST_EMA)
        return ((1 - weight) * overhead + weight * delta) / scale


def batch_costs(costs: Costs, batch: int) -> Costs:
    """Prior costs of a cycle over `batch` rows, from the single-row calibration: a batched
    verify of width w reads the weights once, like one forward of batch·w tokens (extrapolated
    along the mean calibrated slope past the widest width); drafts run once per row. The
    policy corrects these by the cycle times it measures at that batch size."""
    t = costs.target_s
    slope = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else t[0]  # seconds per token past the widest

    def forward(n: int) -> float:
        return t[n - 1] if n <= len(t) else t[-1] + slope * (n - len(t))

    return Costs(tuple(forward(batch * w) for w in range(1, len(t) + 1)),
                 tuple(batch * d for d in costs.draft_s), tuple(batch * s for s in costs.slope_s))


class BatchWidthPolicy:
    """Each batch cycle's width (1 = plain batched decoding): an `AdaptiveBlockPolicy` per
    batch size, with that size's costs (`batch_costs`) and its own learned overheads, all
    sharing one acceptance estimate (acceptance belongs to the drafter and the text, not to
    the batch). So speculation turns off at a concurrency where it stops paying.

    A new batch size starts from the overheads learned at the nearest size seen, scaled by the
    row count (host work and attention grow with the rows), so it does not relearn them from
    zero. `acceptance` may be shared with the single-stream policy. `width` and `batch` hold
    the last choice (for `/metrics`)."""

    def __init__(self, costs: Costs, acceptance: AcceptanceEstimate | None = None, **policy_kwargs):
        self.costs, self.policy_kwargs = costs, policy_kwargs
        self.by_batch: dict[int, AdaptiveBlockPolicy] = {}
        self.acceptance = acceptance
        self.width = self.batch = 0

    def policy(self, batch: int) -> AdaptiveBlockPolicy:
        p = self.by_batch.get(batch)
        if p is not None:
            return p
        p = AdaptiveBlockPolicy(batch_costs(self.costs, batch), **self.policy_kwargs)
        if self.acceptance is None:
            self.acceptance = p.acceptance
        p.acceptance = self.acceptance
        if self.by_batch:
            near = min(self.by_batch, key=lambda b: abs(b - batch))
            scale = batch / near
            p.plain_overhead_s = self.by_batch[near].plain_overhead_s * scale
            p.spec_overhead_s = self.by_batch[near].spec_overhead_s * scale
        self.by_batch[batch] = p
        return p

    def begin(self) -> None:
        """A new reply joins the batch: see `AdaptiveBlockPolicy.begin` (the shared acceptance
        evidence fades once)."""
        for p in self.by_batch.values():
            p.after_plain = True
            p.restart_probes()
        if self.acceptance is not None:
            self.acceptance.fade(REPLY_FADE)

    def next_width(self, max_width: int, batch: int) -> int:
        p = self.policy(batch)
        if not p.spec_seen:  # a speculative cycle costs at least a plain one's host work
            p.spec_overhead_s = max(p.spec_overhead_s, p.plain_overhead_s)
        self.width, self.batch = p.next_width(max_width), batch
        return self.width

    def observe(self, batch: int, cycle, rows: list[tuple[int, int]]) -> None:
        self.policy(batch).observe(cycle, rows)


class FixedBlockPolicy:
    """Always the same width (the engine's behaviour without a policy); a twin for tests."""

    def __init__(self, width: int):
        self.width = width

    def begin(self) -> None:
        pass

    def next_width(self, max_width: int) -> int:
        return min(self.width, max_width)

    def observe(self, cycle) -> None:
        pass


# -- calibration cache ------------------------------------------------------------------


@dataclass
class Calibration:
    """Measured costs of one model pair on one machine, as cached on disk."""

    key: str
    costs: Costs
    machine: dict
    model: dict
    created: float = field(default_factory=time.time)
    n_context: int = 0
    repeats: int = 0
    slope_context: int = 0  # the longer context of the two that `Costs.slope_s` comes from

    def to_dict(self) -> dict:
        out = asdict(self)
        out["costs"] = {"target_s": list(self.costs.target_s), "draft_s": list(self.costs.draft_s),
                        "slope_s": list(self.costs.slope_s)}
        out["schema"] = CALIBRATION_SCHEMA
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        if data.get("schema") != CALIBRATION_SCHEMA:
            raise ValueError(f"calibration schema {data.get('schema')!r}, expected {CALIBRATION_SCHEMA}")
        costs = Costs(tuple(data["costs"]["target_s"]), tuple(data["costs"]["draft_s"]),
                      tuple(data["costs"].get("slope_s", ())))
        return cls(key=data["key"], costs=costs, machine=data["machine"], model=data["model"],
                   created=data["created"], n_context=data.get("n_context", 0), repeats=data.get("repeats", 0),
                   slope_context=data.get("slope_context", 0))


def default_cache_dir() -> Path:
    """`<dflash2 cache>/calibration` ($DFLASH2_HOME, default ~/.cache/dflash2)."""
    from .. import paths

    return paths.home() / "calibration"


def load_calibration(key: str, cache_dir: Path | None = None) -> Calibration | None:
    path = Path(cache_dir or default_cache_dir()) / f"{key}.json"
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, from another schema, or damaged: measure again


def save_calibration(cal: Calibration, cache_dir: Path | None = None) -> Path:
    folder = Path(cache_dir or default_cache_dir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cal.key}.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    return path


def calibration_info(cache_dir: Path | None = None) -> list[dict]:
    """Every cached calibration, newest first, summarised for `dflash2 doctor`."""
    folder = Path(cache_dir or default_cache_dir())
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        cal = load_calibration(path.stem, folder)
        if cal is None:
            continue
        rates = expected_rates(cal.costs, [1.0], cal.costs.max_width)
        out.append({
            "path": str(path),
            "target": cal.model.get("target", {}).get("path"),
            "drafter": _drafter_label(cal.model.get("drafter", {})),
            "machine": cal.machine.get("summary"),
            "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(cal.created)),
            "max_width": cal.costs.max_width,
            "plain_ms": 1e3 * cal.costs.target_s[0],
            "cost_ratio_by_width": [round(cal.costs.cycle_s(w) / cal.costs.target_s[0], 3)
                                    for w in range(1, cal.costs.max_width + 1)],
            "context_growth_by_width": [round(cal.costs.growth(w), 3) for w in range(1, cal.costs.max_width + 1)],
            "speculation_can_win": max(rates[1:], default=0.0) > rates[0],
            "created_ts": cal.created,
        })
    out.sort(key=lambda d: -d.pop("created_ts"))
    return out


def _drafter_label(info: dict) -> str | None:
    if info.get("path"):
        return info["path"]
    if not info:
        return None
    return f"{info.get('arch')} drafter ({info.get('n_layers')} layers, hidden {info.get('hidden_size')}, " \
           f"block {info.get('block_size')})"
