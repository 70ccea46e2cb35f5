"""Honest speed: plain decoding (AR) vs DFlash vs DFlash 2 on the same prompts, in one process.

Rules that keep the numbers honest:
* every mode decodes every prompt with the same sampling settings (and the same seed per
  prompt at T > 0), in one process, interleaved prompt by prompt, with the mode order rotated
  from one prompt to the next so no mode always runs first (warm caches, thermal state);
* one untimed warm-up generation per mode first (shape compilation, calibration for `auto`),
  on at most the prompt's last 2,048 tokens, so a long prompt is not prefilled once more per mode;
* with `repeats`, each mode prefills a prompt once and decodes it again from its own prompt
  cache, repeats interleaved in rotating order: at long context, where one prefill takes many
  minutes, decode speed then rests on several runs taken side by side, not one per mode;
* with `turn_tokens`, every run starts from its own copy of one untimed prefill of the prompt's
  prefix and prefills only the last tokens, as an agent's turn after a prefix-cache hit;
* rates are pooled (total tokens / total seconds), not averages of per-prompt rates;
* outputs whose last 64 tokens are a short repeated loop are flagged, and every speedup is
  reported with and without the prompts that looped in any mode (greedy loops accept
  everything and inflate speculative speed);
* at T = 0 every output is compared with the AR output (its first run), token for token.

Per run: prompt tok/s (prefill), time to first token, decode tok/s (tokens after the first,
over the time after the first), τ, the cycle log, peak memory. The arithmetic over cycle logs
(`stats.py`) and the loop detector are pure functions.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import dataclass, field
from typing import Callable

from .bench_turn import TurnPrefix, check_turn
from .core import stats
from .core.events import CycleStats
from .core.generate import stream_generate
from .core.interfaces import DraftModel, WidthPolicy
from .core.sampling import SamplingParams
from .errors import ConfigError
from .prompts import Prompt, SuitePrompts

DEFAULT_N = 8
DEFAULT_MAX_TOKENS = 256
WARMUP_TOKENS = 16
WARMUP_PROMPT_TOKENS = 2048  # a warm-up sees at most this much prompt
LOOP_WINDOW = 64
LOOP_MAX_PERIOD = 32  # at least two exact copies in the window
MODE_KINDS = ("ar", "dflash", "dflash2", "mlx_lm")
KV_PROBE_TOKENS = 1024
SCHEMA = "dflash2.bench/1"


# -- loops ------------------------------------------------------------------------------


def loop_period(tokens: list[int], window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The shortest period p <= max_period with which the last `window` tokens repeat exactly.

    None when the output is shorter than the window or is not such a loop.
    """
    if len(tokens) < window:
        return None
    tail = tokens[-window:]
    for p in range(1, max_period + 1):
        if all(tail[i] == tail[i + p] for i in range(window - p)):
            return p
    return None


# -- modes and runs ---------------------------------------------------------------------


def parse_modes(value: str) -> list[tuple[str, int | str | None]]:
    """`ar,dflash,dflash2@4,dflash2@auto` -> [(kind, block size or None)]."""
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        kind, _, block = item.partition("@")
        if kind not in MODE_KINDS:
            raise ConfigError(f"unknown mode {item!r}; expected {', '.join(MODE_KINDS)} (optionally @WIDTH or @auto)")
        if block and kind in ("ar", "mlx_lm"):
            raise ConfigError(f"mode {item!r}: plain decoding has no block size")
        size: int | str | None = None
        if block:
            if block != "auto" and not (block.isdigit() and int(block) >= 2):
                raise ConfigError(f"mode {item!r}: block size must be an integer >= 2 or 'auto', got {block!r}")
            size = block if block == "auto" else int(block)
        out.append((kind, size))
    if not out:
        raise ConfigError(f"no modes in {value!r}")
    return out


@dataclass
class Mode:
    """One way of decoding: `ar` (no drafter), or a drafter at a block size (None = its own)."""

    name: str
    kind: str
    drafter: DraftModel | None = None
    block_size: int | str | None = None
    drafter_path: str | None = None
    block_policy: WidthPolicy | None = field(default=None, repr=False)

    def width(self) -> int | None:
        if self.drafter is None:
            return None
        return self.drafter.config.block_size if self.block_size in (None, "auto") else int(self.block_size)

    def policy(self, target, cache_dir=None):
        """The mode's block policy (None unless the block size is 'auto').

        One policy serves all of the mode's runs, as in a long-lived server session: what it
        learned about acceptance on earlier prompts carries over to the next.
        """
        if self.drafter is None or self.block_size != "auto":
            return None
        if self.block_policy is None:
            from .core.calibration import auto_policy

            self.block_policy = auto_policy(target, self.drafter, cache_dir=cache_dir)
        return self.block_policy

    def describe(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "drafter": self.drafter_path,
               "block_size": self.block_size if self.drafter is not None else None, "max_width": self.width()}
        p = self.block_policy
        if p is not None:
            out["policy"] = {"n_switches": p.trace.n_switches, "n_probes": p.trace.n_probes,
                             "acceptance_estimate": p.acceptance.rates(),
                             "plain_overhead_s": p.plain_overhead_s,
                             "spec_overhead_per_growth_s": p.spec_overhead_s,
                             "calibrated_target_s": list(p.costs.target_s),
                             "calibrated_draft_s": list(p.costs.draft_s),
                             "context_growth": [p.costs.growth(w) for w in range(1, p.costs.max_width + 1)]}
        return out


def drafter_kind(drafter) -> str:
    """The bench mode a drafter serves: "dflash2" for DFlash 2, "dflash" for v1 variants."""
    return "dflash2" if drafter.config.is_v2 else "dflash"


def build_modes(requested: list[tuple[str, int | str | None]], drafters: dict[str, tuple[object, str | None]],
                block_size: int | str | None = None, required: bool = True) -> tuple[list[Mode], list[str]]:
    """Modes for `parse_modes` output, given the loaded drafters by kind (drafter, path).

    `block_size` applies to modes without their own `@WIDTH`. A mode whose drafter is missing
    is an error when `required`, else skipped with a note.
    """
    modes, notes = [], []
    for kind, size in requested:
        size = size if size is not None else block_size
        name = kind if size is None or kind in ("ar", "mlx_lm") else f"{kind}@{size}"
        if kind in ("ar", "mlx_lm"):
            modes.append(Mode(name, kind))
            continue
        if kind not in drafters:
            flag = "--drafter-v1" if kind == "dflash" else "--drafter"
            if required:
                raise ConfigError(f"mode {name!r} needs a {kind} drafter; pass {flag}")
            notes.append(f"mode {name} skipped: no {kind} drafter (pass {flag})")
            continue
        drafter, path = drafters[kind]
        if size not in (None, "auto") and int(size) > drafter.config.block_size:
            notes.append(f"{name}: wider than the drafter's trained block size {drafter.config.block_size}")
        modes.append(Mode(name, kind, drafter, size, str(path) if path else None))
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ConfigError(f"modes repeat: {names}")
    return modes, notes


@dataclass
class RunRecord:
    """One prompt decoded by one mode: every raw figure."""

    suite: str
    prompt_id: str
    mode: str
    n_prompt_tokens: int
    n_tokens: int
    finish_reason: str | None
    prompt_tps: float
    ttft_s: float
    decode_s: float
    total_s: float
    peak_memory_gb: float
    cycles: list[list] = field(default_factory=list)  # [width, n_drafted, n_accepted, n_emitted, draft_s, verify_s]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    seed: int | None = None
    loop_period: int | None = None
    matches_ar: bool | None = None
    n_cached: int = 0  # prompt tokens its prompt cache held (a repeat, a turn's prefix): not prefilled here
    repeat: int = 0  # which decode of this prompt in this mode (0: the one that prefilled)
    other_caches_gb: float = 0.0  # other modes' prompt caches held during it (repeats), out of its peak

    @property
    def n_prefilled(self) -> int:
        """Prompt tokens this run fed through the target (the rest came from a prompt cache)."""
        return self.n_prompt_tokens - self.n_cached

    @property
    def decode_tps(self) -> float:
        return (self.n_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tau(self) -> float | None:
        return stats.tau(self.cycle_stats(), empty=None)

    def cycle_stats(self) -> list[CycleStats]:
        return [CycleStats(*c) for c in self.cycles]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(decode_tps=self.decode_tps, tau=self.tau, n_prefilled=self.n_prefilled)
        return out


def default_encoder(target) -> Callable[[Prompt], list[int]]:
    """Prompt -> ids through the target's chat template, as `dflash2 run` does."""
    from .session import Session

    session = Session(spec=None, target=target, drafter=None, block_size=None)
    return lambda prompt: session.encode(prompt.text)


def mlx_lm_cache(target, kv: dict) -> list:
    """A fresh mlx-lm prompt cache for the reference mode; with `kv` (kv_bits, kv_group_size),
    mlx-lm's `QuantizedKVCache`, quantized from the first token as ours is (its own `kv_bits`
    keeps the first prefill chunk, 2,048 tokens, at full precision, which prefills faster and
    rounds differently)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(target.model)
    if kv.get("kv_bits"):
        cache = [c.to_quantized(kv["kv_group_size"], kv["kv_bits"]) if type(c) is KVCache else c for c in cache]
    return cache


def _mlx_lm_tokens(cache: list) -> int:
    """Tokens an mlx-lm prompt cache holds (its attention layers' offset)."""
    return next((c.offset for c in cache if hasattr(c, "offset")), 0)


def _run_mlx_lm(target, ids: list[int], max_tokens: int, sampling: SamplingParams, kv: dict,
                cache: list | None = None) -> RunRecord:
    """The reference: `mlx_lm.stream_generate` itself on the same model, timed like our modes.
    `cache` (from `mlx_lm_cache`) may already hold a prefix of the prompt, as mlx-lm's server
    reuses one: then only the rest is fed, and the cache is trimmed back to all but the
    prompt's last token afterwards (what a repeat reuses)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate as mlx_stream_generate
    from mlx_lm.models.cache import trim_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    sampler = None if sampling.greedy else make_sampler(sampling.temperature, sampling.top_p,
                                                        min_p=sampling.min_p, top_k=sampling.top_k)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    kept, cache = cache is not None, cache if cache is not None else mlx_lm_cache(target, kv)
    n_cached = _mlx_lm_tokens(cache)
    if n_cached >= len(ids):
        raise ValueError(f"an mlx-lm cache must hold a proper prefix of the {len(ids)}-token prompt, holds {n_cached}")
    tokens, text, last, t_first = [], [], None, None
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for r in mlx_stream_generate(target.model, target.tokenizer, mx.array(ids[n_cached:]), max_tokens=max_tokens,
                                 sampler=sampler, prompt_cache=cache):
        t_first = t_first or time.perf_counter()
        if r.finish_reason != "stop" or r.token not in target.tokenizer.eos_token_ids:
            tokens.append(r.token)  # its last response repeats no token but may carry the EOS
        text.append(r.text)
        last = r
    t_end = time.perf_counter()
    if kept:
        trim_prompt_cache(cache, _mlx_lm_tokens(cache) - (len(ids) - 1))  # what a repeat reuses
    return RunRecord(
        suite="", prompt_id="", mode="mlx_lm", n_prompt_tokens=len(ids), n_tokens=len(tokens), n_cached=n_cached,
        finish_reason=last.finish_reason, prompt_tps=last.prompt_tps, ttft_s=t_first - t0,
        decode_s=t_end - t_first, total_s=t_end - t0, peak_memory_gb=last.peak_memory, tokens=tokens,
        text="".join(text), seed=sampling.seed, loop_period=loop_period(tokens),
    )


def run_once(target, mode: Mode, ids: list[int], max_tokens: int, sampling: SamplingParams,
             cache_dir=None, kv: dict | None = None, cache=None) -> RunRecord:
    """Decode `ids` with `mode`, timing from the call to the last token; `kv` holds `kv_bits`
    and `kv_group_size` (quantized K/V) or is empty. `cache` (from `mode_cache`) is the mode's
    prompt cache: empty, the prompt is prefilled into it; holding the prompt, only its last
    token is fed (a repeat)."""
    kv = kv or {}
    if mode.kind == "mlx_lm":
        record = _run_mlx_lm(target, ids, max_tokens, sampling, kv, cache)
        record.mode = mode.name
        return record
    policy = mode.policy(target, cache_dir)  # before the clock: may load or measure a calibration
    tokens, cycles, text, last = [], [], [], None
    t0 = time.perf_counter()
    t_first = None
    for ev in stream_generate(target, ids, drafter=mode.drafter, max_tokens=max_tokens, sampling=sampling,
                              block_size=mode.width(), block_policy=policy, prompt_cache=cache, **kv):
        if t_first is None:
            t_first = time.perf_counter()
        tokens.extend(ev.tokens)
        text.append(ev.text)
        if ev.cycle is not None:
            c = ev.cycle
            cycles.append([c.width, c.n_drafted, c.n_accepted, c.n_emitted, c.draft_s, c.verify_s])
        last = ev
    t_end = time.perf_counter()
    return RunRecord(
        suite="", prompt_id="", mode=mode.name, n_prompt_tokens=len(ids), n_tokens=len(tokens),
        n_cached=cache.last_reuse.n_cached if cache is not None else 0, finish_reason=last.finish_reason,
        prompt_tps=last.prompt_tps, ttft_s=t_first - t0,
        decode_s=t_end - t_first, total_s=t_end - t0, peak_memory_gb=last.peak_memory_gb,
        cycles=cycles, tokens=tokens, text="".join(text), seed=sampling.seed,
        loop_period=loop_period(tokens),
    )


# -- the benchmark ----------------------------------------------------------------------


@dataclass
class BenchReport:
    settings: dict
    suites: list[dict]
    modes: list[dict]
    records: list[RunRecord]
    notes: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=dict)

    @property
    def mode_names(self) -> list[str]:
        return [m["name"] for m in self.modes]

    def looping_prompts(self) -> set[tuple[str, str]]:
        """Prompts whose output looped in at least one mode."""
        return {(r.suite, r.prompt_id) for r in self.records if r.loop_period is not None}

    def summary(self, exclude_loops: bool = False) -> dict:
        loops = self.looping_prompts() if exclude_loops else set()
        kept = [r for r in self.records if (r.suite, r.prompt_id) not in loops]
        by_suite = {s["name"]: self._overhead(summarize([r for r in kept if r.suite == s["name"]], self.mode_names))
                    for s in self.suites}
        return {"overall": self._overhead(summarize(kept, self.mode_names)), "by_suite": by_suite,
                "excluded_prompts": sorted(f"{s}/{p}" for s, p in loops)}

    def _overhead(self, figures: dict) -> dict:
        """Add each mode's mean cycle time over (drafter alone + verify alone): 1.0 = no overhead."""
        isolated = {m["name"]: m.get("isolated") for m in self.modes}
        for name, f in figures.items():
            iso = isolated.get(name)
            alone = iso["draft_ms"] + iso["verify_ms"] if iso else None
            f["cycle_over_isolated"] = f["cycle_ms"] / alone if alone and f.get("cycle_ms") else None
        return figures

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": self.machine,
            "settings": self.settings, "suites": self.suites, "modes": self.modes, "notes": self.notes,
            "summary": self.summary(), "summary_without_loops": self.summary(exclude_loops=True),
            "loops": [{"suite": r.suite, "prompt_id": r.prompt_id, "mode": r.mode, "period": r.loop_period}
                      for r in self.records if r.loop_period is not None],
            "runs": [r.to_dict() for r in self.records],
        }


def summarize(records: list[RunRecord], modes: list[str], baseline: str = "ar") -> dict:
    """Pooled figures per mode over `records`; speedups against `baseline` when it ran."""
    out = {}
    for mode in modes:
        runs = [r for r in records if r.mode == mode]
        if not runs:
            continue
        cycles = [c for r in runs for c in r.cycle_stats()]
        decode_tokens = sum(r.n_tokens - 1 for r in runs)
        decode_s = sum(r.decode_s for r in runs)
        prefills = [r for r in runs if r.n_prefilled > 1]  # a repeat's prompt figures are one token's
        prefill_s = sum(r.n_prefilled / r.prompt_tps for r in prefills if r.prompt_tps > 0)
        spec = stats.speculative(cycles)
        out[mode] = {
            "n_runs": len(runs),
            "n_prefills": len(prefills),
            "n_prompt_tokens": sum(r.n_prompt_tokens for r in prefills),
            "n_prefilled_tokens": sum(r.n_prefilled for r in prefills),
            "n_tokens": sum(r.n_tokens for r in runs),
            "prompt_tps": sum(r.n_prefilled for r in prefills) / prefill_s if prefill_s else None,
            "ttft_s": sum(r.ttft_s for r in prefills) / len(prefills) if prefills else None,
            "decode_tps": decode_tokens / decode_s if decode_s > 0 else None,
            "e2e_tps": sum(r.n_tokens for r in runs) / sum(r.total_s for r in runs),
            "tau": stats.tau(cycles, empty=None),
            "acceptance_by_position": stats.rates(stats.acceptance_counts(cycles)),
            "acceptance_counts": stats.acceptance_counts(cycles),
            "accepted_histogram": stats.accepted_histogram(cycles),
            "mean_width": sum(c.width for c in spec) / len(spec) if spec else 1.0,
            "plain_steps": sum(1 for c in cycles if c.n_drafted == 0),
            "n_speculative_cycles": len(spec),
            "peak_memory_gb": max(r.peak_memory_gb - r.other_caches_gb for r in runs),
            "n_loops": sum(r.loop_period is not None for r in runs),
            "n_mismatch_vs_ar": sum(r.matches_ar is False for r in runs),
            "cycle_ms": 1e3 * sum(c.draft_s + c.verify_s for c in spec) / len(spec) if spec else None,
            "draft_ms": 1e3 * sum(c.draft_s for c in spec) / len(spec) if spec else None,
            "verify_ms": 1e3 * sum(c.verify_s for c in spec) / len(spec) if spec else None,
        }
    base, reference = out.get(baseline), out.get("mlx_lm")
    for figures in out.values():
        figures["speedup"] = _ratio(figures["decode_tps"], base and base["decode_tps"])
        figures["e2e_speedup"] = _ratio(figures["e2e_tps"], base and base["e2e_tps"])
        figures["speedup_vs_mlx_lm"] = _ratio(figures["decode_tps"], reference and reference["decode_tps"])
    return out


def _ratio(value, base) -> float | None:
    return value / base if value and base else None


def isolated_costs(target, mode: Mode, n_context: int, repeats: int = 3) -> dict | None:
    """A fixed-width mode's drafter pass alone and verify pass alone (median ms, at `n_context`
    tokens of context), against which its measured cycle time shows the engine's overhead."""
    from .core.calibration import measure_costs

    width = mode.width()
    if mode.drafter is None or mode.block_size == "auto" or width is None:
        return None
    costs = measure_costs(target, mode.drafter, width, n_context=n_context, repeats=repeats, slope_context=0)
    return {"width": width, "n_context": n_context, "draft_ms": 1e3 * costs.draft_s[width - 1],
            "verify_ms": 1e3 * costs.target_s[width - 1]}


def kv_bytes_per_token(target, ids: list[int], kv: dict, n: int = KV_PROBE_TOKENS) -> float:
    """The target caches' bytes per token after a prefill of the first `n` tokens of `ids`
    (with `kv`'s quantization): what a long prompt costs in memory, per token."""
    from .core.prompt_cache import PromptCache

    cache = PromptCache(target, None, reserve=1, **kv)
    ids = ids[:n]
    for _ in stream_generate(target, ids, max_tokens=1, prompt_cache=cache):
        pass
    return cache.nbytes / len(cache.tokens)


def mode_cache(target, mode: Mode, kv: dict):
    """A fresh prompt cache for `mode` (mlx-lm's for the reference), through which a repeat
    decodes the same prompt again without prefilling it."""
    if mode.kind == "mlx_lm":
        return mlx_lm_cache(target, kv)
    from .core.prompt_cache import DEFAULT_RESERVE, PromptCache

    return PromptCache(target, mode.drafter, reserve=max(DEFAULT_RESERVE, mode.width() or 1), **kv)


def mode_cache_nbytes(cache) -> int:
    """Bytes a `mode_cache` holds."""
    from .core.cache_kinds import cache_nbytes

    return cache.nbytes if hasattr(cache, "nbytes") else sum(cache_nbytes(c) for c in cache)


def _check_repeatable(target, modes: list[Mode], kv: dict) -> None:
    """Repeats need the reference's cache to be trimmed back to the prompt (ours fall back on a
    snapshot where they cannot trim)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    if not any(m.kind == "mlx_lm" for m in modes):
        return
    cache = mlx_lm_cache(target, kv)
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise ConfigError(f"repeats > 1 with the mlx_lm mode needs trimmable caches; this target has {kinds}")


def _warm_up(target, modes: list[Mode], ids: list[int], max_tokens: int, sampling: SamplingParams,
             cache_dir, kv: dict) -> None:
    """One untimed generation per mode on at most the prompt's last WARMUP_PROMPT_TOKENS tokens:
    that compiles every shape a run uses, and a whole long prompt would cost one more prefill per
    mode (40-85 min at 28k on 2 CPU cores) to warm buffers whose allocation takes seconds."""
    for mode in modes:
        run_once(target, mode, ids[-WARMUP_PROMPT_TOKENS:], min(WARMUP_TOKENS, max_tokens), sampling, cache_dir, kv)


def _mark_matches(records: list[RunRecord]) -> None:
    """Every run's tokens against plain decoding's first run of the same prompt (greedy)."""
    ar = {(r.suite, r.prompt_id): r for r in records if r.mode == "ar" and r.repeat == 0}
    for r in records:
        truth = ar.get((r.suite, r.prompt_id))
        if truth is not None and r is not truth:
            r.matches_ar = r.tokens == truth.tokens


def run_bench(target, modes: list[Mode], suites: list[SuitePrompts], max_tokens: int = DEFAULT_MAX_TOKENS,
              sampling: SamplingParams | None = None, encode: Callable[[Prompt], list[int]] | None = None,
              warmup: bool = True, on_run: Callable[[RunRecord], None] | None = None,
              cache_dir=None, isolated: bool = True, kv_bits: int | None = None,
              kv_group_size: int | None = None, repeats: int = 1, turn_tokens: int | None = None) -> BenchReport:
    """Decode every prompt of every suite with every mode, interleaved; see the module doc.

    Args:
        modes: distinct names; a mode named "ar" is the speedup baseline.
        sampling: default greedy. At T > 0 prompt j gets seed `sampling.seed + j` (seed
            default 0) in every mode.
        encode: Prompt -> token ids (default: the target's chat template).
        on_run: called after each run (progress).
        cache_dir: where `auto` block policies keep their calibration (default: user cache).
        isolated: also time each fixed-width mode's drafter pass and verify pass alone
            (with full-precision K/V).
        kv_bits, kv_group_size: every mode's target K/V quantized (mlx_lm's too).
        repeats: decodes of each prompt per mode. Past the first, each mode decodes again from
            its own prompt cache (mlx-lm's for the reference), which holds all but the
            prompt's last token, in rotating order: long prompts are prefilled once per mode,
            and decode speed is averaged over `repeats` interleaved runs.
        turn_tokens: each run starts from a copy of a cache holding all but the prompt's last
            `turn_tokens` tokens (prefilled once, untimed; `bench_turn`), as an agent's turn
            after a prefix-cache hit: prefill and TTFT then measure those tokens alone.
    """
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ConfigError(f"mode names must be distinct, got {names}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    sampling = sampling or SamplingParams()
    encode = encode or default_encoder(target)
    prompts = [p for s in suites for p in s.prompts]
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    encoded = [encode(p) for p in prompts]
    kv = {}
    if kv_bits is not None:
        target.make_cache(kv_bits=kv_bits, kv_group_size=kv_group_size)  # refuse a bad combination first
        kv = {"kv_bits": kv_bits, "kv_group_size": target.kv_group_size(kv_bits, kv_group_size)}
    if turn_tokens is not None:
        check_turn(turn_tokens, [len(ids) for ids in encoded], target, modes, kv)
    elif repeats > 1:
        _check_repeatable(target, modes, kv)
    if warmup:
        _warm_up(target, modes, encoded[0], max_tokens, sampling, cache_dir, kv)
    base_seed = sampling.seed if sampling.seed is not None else 0
    records = []
    for j, (prompt, ids) in enumerate(zip(prompts, encoded)):
        params = sampling if sampling.greedy else dataclasses.replace(sampling, seed=base_seed + j)
        order = modes[j % len(modes):] + modes[: j % len(modes)]
        prefix = TurnPrefix(target, modes, ids, len(ids) - turn_tokens, kv) if turn_tokens is not None else None
        caches = {m.name: mode_cache(target, m, kv) for m in modes} if repeats > 1 and prefix is None else {}
        for r in range(repeats):
            for mode in order[r % len(order):] + order[: r % len(order)]:
                if prefix is not None:
                    cache, held = prefix.copy_for(mode), prefix.nbytes
                else:
                    cache = caches.get(mode.name)
                    held = sum(mode_cache_nbytes(c) for name, c in caches.items() if name != mode.name)
                record = run_once(target, mode, ids, max_tokens, params, cache_dir, kv, cache)
                record.suite, record.prompt_id, record.repeat = prompt.suite, prompt.id, r
                record.other_caches_gb = held / 1e9
                records.append(record)
                if on_run is not None:
                    on_run(record)
        del caches, prefix
    if sampling.greedy:
        _mark_matches(records)
    described = [m.describe() for m in modes]
    if isolated:  # after the runs, so that it never warms anything up for one mode only
        n_context = sum(len(ids) for ids in encoded) // len(encoded) + max_tokens // 2
        for info, mode in zip(described, modes):
            info["isolated"] = isolated_costs(target, mode, n_context)
    settings = {"max_tokens": max_tokens, "sampling": sampling.to_dict(), "warmup": warmup,
                "kv_cache_bytes_per_token": kv_bytes_per_token(target, encoded[0], kv),
                "loop_window": LOOP_WINDOW, "loop_max_period": LOOP_MAX_PERIOD,
                "n_prompts": len(prompts), "interleaved": True, "repeats": repeats, "turn_tokens": turn_tokens,
                "kv_bits": kv.get("kv_bits"),
                "kv_group_size": kv.get("kv_group_size")}
    suites_info = [{"name": s.name, "source": s.source, "available": s.available, "n": len(s.prompts)}
                   for s in suites]
    return BenchReport(settings=settings, suites=suites_info, modes=described,
                       records=records, machine=machine_info())


def machine_info() -> dict:
    from .core.calibration import machine_fingerprint

    return {**machine_fingerprint(), "platform": platform.platform()}
