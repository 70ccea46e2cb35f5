"""Measure what `block_policy` needs on this machine: target forward and drafter costs by width.

`calibrate` prefills the target with a fixed context, then times, for every width w in
1..max_width, one target forward of w tokens (taps, logits of every position, argmax) and one
drafter call proposing w - 1 tokens, exactly the two halves of an engine cycle. Widths are
interleaved within each round so drift (thermal, other processes) spreads evenly; the first
round warms up shapes and is discarded; each cost is the median of the remaining rounds,
then smoothed to be non-decreasing in width (a dip is noise). Both caches are rolled back
to one new token per measurement, so the context stays put. The target forwards are then
timed again over a context stretched to `DEFAULT_SLOPE_CONTEXT` tokens (its keys and values
repeated, no prefill): how fast each width's cost grows with the context (`Costs.slope_s`),
which on a CPU, where each verified row attends on its own, is far faster for wide blocks.

The cache key covers the machine (CPU/GPU, OS, MLX version, BLAS) and the pair (paths, file
sizes and times, shapes, dtypes, quantization), so a change to any of them measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .block_policy import (
    AdaptiveBlockPolicy,
    Calibration,
    Costs,
    default_cache_dir,
    load_calibration,
    nondecreasing,
    save_calibration,
)
from .cache_kinds import kind_of

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 256
DEFAULT_REPEATS = 3
# The target's costs are measured again over this many tokens of context: how each width's cost
# grows with it (on a CPU each verified row attends on its own; a GPU reads the K/V once).
DEFAULT_SLOPE_CONTEXT = 4096
PREFILL_CHUNK = 512


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint() -> dict:
    """What makes timings on this machine differ from another's."""
    try:
        info = mx.device_info()
        device = str(info.get("device_name") or info.get("architecture") or "")
    except Exception:  # device_info is absent on some backends/builds
        device = ""
    from ..blas import active_blas

    blas = active_blas()["name"]
    fields = {
        "host": platform.node(),
        "system": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "n_cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "device_name": device,
        "mlx": mx.__version__,
        "blas": blas if platform.system() == "Linux" else "system",
    }
    gpu = f" / {device}" if device and device != fields["cpu"] else ""
    fields["summary"] = f"{fields['cpu']}{gpu}, {fields['device']}, mlx {fields['mlx']}, {fields['blas']} BLAS"
    return fields


def _files_stamp(path) -> list:
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        return []
    return [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in sorted(folder.glob("*.safetensors"))]


def _weights_kind(module) -> dict:
    """Dtypes, quantization and a cheap checksum (tells apart same-shaped weights)."""
    leaves = tree_flatten(module.parameters())
    first = next((v for _, v in leaves if v.ndim >= 2), None)
    checksum = None if first is None else round(float(mx.sum(first[:8].astype(mx.float32)).item()), 4)
    return {"dtypes": sorted({str(v.dtype) for _, v in leaves}),
            "quantized": any(name.endswith("scales") for name, _ in leaves), "checksum": checksum}


def model_fingerprint(target, drafter) -> dict:
    """The target and drafter facts that change their costs."""
    drafter_path = getattr(drafter, "path", None)
    return {
        "target": {"path": target.path, "model_type": target.info.model_type, "n_layers": target.info.n_layers,
                   "hidden_size": target.info.hidden_size, "vocab_size": target.info.vocab_size,
                   "files": _files_stamp(target.path), **_weights_kind(target.model)},
        "drafter": {"path": str(drafter_path) if drafter_path else None, "arch": drafter.config.arch,
                    "n_layers": drafter.config.num_hidden_layers, "hidden_size": drafter.config.hidden_size,
                    "block_size": drafter.config.block_size, "files": _files_stamp(drafter_path),
                    **_weights_kind(drafter)},
    }


def calibration_key(machine: dict, model: dict) -> str:
    blob = json.dumps({"machine": machine, "model": model}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _time_target(target, cache, taps, tokens: mx.array) -> tuple[float, mx.array]:
    width = tokens.shape[1]
    target.arm(cache)
    t0 = time.perf_counter()
    logits, hidden = target.forward(tokens, cache, taps, "all" if width > 1 else "last")
    choice = mx.argmax(logits, axis=-1)
    mx.eval(choice, hidden)
    seconds = time.perf_counter() - t0
    target.commit(cache, n_fed=width, n_keep=1)
    return seconds, hidden[:, :1]


def _time_drafter(drafter, cache, anchor: mx.array, ctx: mx.array, width: int) -> float:
    t0 = time.perf_counter()
    proposal = drafter.draft_from(anchor, ctx, cache, width, 0.0)
    mx.eval(proposal.tokens)
    return time.perf_counter() - t0


def _context_ids(target, n_context: int, max_width: int) -> mx.array:
    """The fixed random context every calibration measures after (the same on every rank)."""
    rng = np.random.default_rng(0)
    return mx.array(rng.integers(3, target.info.vocab_size, size=(1, n_context + max_width)), dtype=mx.int32)


def _rounds(max_width: int, repeats: int) -> list[list[int]]:
    """The widths of each round in measuring order: interleaved, rotated each round."""
    order = list(range(1, max_width + 1))
    return [order[rnd % max_width:] + order[: rnd % max_width] for rnd in range(repeats + 1)]


def _prefilled(target, ids: mx.array, n_context: int, max_width: int, taps: tuple[int, ...]):
    """A target cache holding `ids[:, :n_context]` (in chunks, as a prefill runs) and the taps
    of every context token (None without taps). Each chunk runs to its logits, so a sharded
    target's ranks run alike."""
    cache, hidden = target.make_cache(reserve=max_width), []
    for start in range(0, n_context, PREFILL_CHUNK):
        logits, chunk = target.forward(ids[:, start : start + PREFILL_CHUNK], cache, taps, "last")
        mx.eval(logits, chunk if chunk is not None else [], [c.state for c in cache])
        hidden += [chunk] if chunk is not None else []
    return cache, mx.concatenate(hidden, axis=1) if hidden else None


def _slope_context(n_context: int, slope_context: int) -> int:
    """The longer context, or 0 when it is not longer (no slopes then)."""
    return slope_context if slope_context > n_context else 0


def measure_costs(target, drafter, max_width: int, n_context: int = DEFAULT_CONTEXT,
                  repeats: int = DEFAULT_REPEATS, progress=None,
                  slope_context: int = DEFAULT_SLOPE_CONTEXT) -> Costs:
    """Median seconds of a target forward and a drafter call for widths 1..max_width, and each
    target forward's growth per context token, from its cost after `slope_context` tokens.

    `progress(done, total)` is called after each round, if given. On a sharded target, every
    other rank runs `follow_measurement` meanwhile: the passes are collective.
    """
    far = _slope_context(n_context, slope_context)
    ids = _context_ids(target, n_context, max_width)
    taps = tuple(drafter.config.target_layer_ids)
    rounds = _rounds(max_width, repeats)
    total = len(rounds) * (2 if far else 1)
    cache, hidden = _prefilled(target, ids, n_context, max_width, taps)
    draft_cache = drafter.make_cache()
    anchor = ids[0, n_context : n_context + 1]
    mx.eval(drafter.draft_from(anchor, hidden, draft_cache, 2, 0.0).tokens)
    tokens = ids[:, n_context:]
    near_s, draft_s = _time_widths(target, cache, tokens, taps, rounds,
                                   None if progress is None else (lambda rnd: progress(rnd, total)),
                                   lambda w, ctx: _time_drafter(drafter, draft_cache, anchor, ctx, w))
    near = nondecreasing(near_s)
    draft = [0.0] + nondecreasing(draft_s[1:])
    slope: tuple[float, ...] = ()
    if far:
        _stretch(cache, far)
        far_s, _ = _time_widths(target, cache, tokens, taps, rounds,
                                None if progress is None else (lambda rnd: progress(len(rounds) + rnd, total)))
        far_s = nondecreasing(far_s)
        slope = tuple(nondecreasing([max(f - t, 0.0) / (far - n_context) for f, t in zip(far_s, near)]))
    return Costs(tuple(near), tuple(draft), slope)


def _stretch(cache: list, n_context: int) -> None:
    """Every layer cache that holds keys and values extended to `n_context` tokens by repeating
    what it holds: a forward's cost follows how many keys it attends over, not what they are,
    so this stands in for a long prefill at almost no cost. Recurrent states keep their size."""
    for c in cache:
        kind = kind_of(c)
        if kind.replays:
            continue
        while c.offset < n_context:
            keys, values = kind.stored(c)
            n = min(keys.shape[-2], n_context - c.offset, PREFILL_CHUNK)
            c.update_and_fetch(keys[..., :n, :], values[..., :n, :])
            mx.eval([c.state])


def _time_widths(target, cache: list, tokens: mx.array, taps: tuple[int, ...], rounds: list[list[int]],
                 done=None, time_draft=None) -> tuple[list[float], list[float]]:
    """Median seconds of a target forward of each width over `cache` and, with
    `time_draft(width, ctx) -> seconds`, of the drafter call after it (0 at width 1 or without).
    Round 0 warms up every shape and is not counted; `done(round)` follows each round."""
    target_s = [[] for _ in range(len(rounds[0]))]
    draft_s = [[] for _ in range(len(rounds[0]))]
    for rnd, widths in enumerate(rounds):
        for w in widths:
            t_target, ctx = _time_target(target, cache, taps, tokens[:, :w])
            t_draft = time_draft(w, ctx) if time_draft is not None and w >= 2 else 0.0
            if rnd > 0:
                target_s[w - 1].append(t_target)
                draft_s[w - 1].append(t_draft)
        if done is not None:
            done(rnd + 1)
    return [statistics.median(s) for s in target_s], [statistics.median(s) for s in draft_s]


def follow_measurement(target, max_width: int, n_context: int = DEFAULT_CONTEXT,
                       repeats: int = DEFAULT_REPEATS, slope_context: int = DEFAULT_SLOPE_CONTEXT) -> None:
    """A rank other than 0 of a sharded target: the same target passes as rank 0's
    `measure_costs`, in the same order (their collectives need every rank); no drafter."""
    far = _slope_context(n_context, slope_context)
    ids = _context_ids(target, n_context, max_width)
    cache, _ = _prefilled(target, ids, n_context, max_width, ())
    for context in (n_context, far) if far else (n_context,):
        _stretch(cache, context)
        for w in (w for widths in _rounds(max_width, repeats) for w in widths):
            target.arm(cache)
            mx.eval(target.forward(ids[:, n_context : n_context + w], cache, (), "last")[0])
            target.commit(cache, n_fed=w, n_keep=1)


def calibrate(target, drafter, max_width: int, key: str, machine: dict, model: dict,
              n_context: int = DEFAULT_CONTEXT, repeats: int = DEFAULT_REPEATS, progress=None) -> Calibration:
    slope_context = _slope_context(n_context, DEFAULT_SLOPE_CONTEXT)
    costs = measure_costs(target, drafter, max_width, n_context, repeats, progress, slope_context)
    return Calibration(key=key, costs=costs, machine=machine, model=model, n_context=n_context, repeats=repeats,
                       slope_context=slope_context)


# -- the cached calibration and the policy made from it ------------------------------------


def get_calibration(target, drafter, max_width: int | None = None, cache_dir: Path | None = None,
                    refresh: bool = False, progress=None) -> Calibration:
    """The cached calibration for this machine + pair, measuring it first if needed."""
    width = max(2, max_width or drafter.config.block_size)
    machine, model = machine_fingerprint(), model_fingerprint(target, drafter)
    key = calibration_key(machine, model)
    cal = None if refresh else load_calibration(key, cache_dir)
    if cal is None or cal.costs.max_width < width:
        cal = _measure_and_save(target, drafter, width, key, machine, model, cache_dir, progress)
    return cal


def _measure_and_save(target, drafter, width: int, key: str, machine: dict, model: dict, cache_dir, progress):
    log.warning("measuring target and drafter costs for widths 1..%d on this machine (once; cached in %s)",
                width, Path(cache_dir or default_cache_dir()))
    cal = calibrate(target, drafter, width, key=key, machine=machine, model=model, progress=progress)
    save_calibration(cal, cache_dir)
    return cal


def agree_calibration(lockstep, target, drafter, max_width: int | None = None, cache_dir: Path | None = None,
                      progress=None) -> Calibration | None:
    """A sharded target's calibration, measured in the distributed setting: rank 0's cache says
    whether to measure (the key covers the group), and then every rank takes part in each
    timed target pass. Every rank calls this, at the same point; rank 0 gets the calibration,
    the others (which hold no drafter) None."""
    width, cal = 0, None
    if lockstep.leader:
        machine = machine_fingerprint()
        model = model_fingerprint(target, drafter) | {"sharded": {k: v for k, v in lockstep.describe().items()
                                                                   if k != "rank"}}
        key = calibration_key(machine, model)
        cal = load_calibration(key, cache_dir)
        need = max(2, max_width or drafter.config.block_size)
        width = need if cal is None or cal.costs.max_width < need else 0
    width = int(lockstep.share(mx.array([width])).item())  # 0: rank 0 has it cached
    if width and lockstep.leader:
        cal = _measure_and_save(target, drafter, width, key, machine, model, cache_dir, progress)
    elif width:
        follow_measurement(target, width)
    return cal


def auto_policy(target, drafter, max_width: int | None = None, cache_dir: Path | None = None,
                progress=None, **policy_kwargs) -> AdaptiveBlockPolicy:
    """A fresh `AdaptiveBlockPolicy` for this pair (what `--block-size auto` uses).

    Loads the pair's calibration for this machine from the cache, or measures it once
    (a few seconds) and caches it under `default_cache_dir()`.
    """
    cal = get_calibration(target, drafter, max_width, cache_dir, progress=progress)
    return AdaptiveBlockPolicy(cal.costs, **policy_kwargs)
