"""Exact simulated acceptance: what greedy speculative decoding would accept on held-out data.

For every anchor t of every held-out sequence the drafter drafts the block `[x_t, MASK × (B-1)]`
from the target states before t, as the engine does. A draft position is accepted when it and
every position before it equal the target's greedy token (the DFlash 2 pick is scored with the
true predecessor, which is exact here: a wrong predecessor means that position was already
rejected). So each anchor gets the acceptance length the engine would see there, bonus included:
`1 + leading matches`, in [1, B].

Two figures come from those lengths, for each block size asked:

* `tau`: the engine's τ on these sequences. The walk starts at the first answer token (the
  prompt pass's pick) and jumps by each acceptance length, as decoding does; τ = tokens / cycles.
* `tau_all`: the mean acceptance length over every anchor (the same quantity with far less
  noise, since it uses every position rather than the ones a walk happens to visit).

No independence assumption is made (the old `estimated_tau` multiplied per-position accuracies).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .dataset import FeatureDataset, eval_rows
from .loss import LossWeights, drafter_loss, position_weights


def acceptance_lengths(hits: np.ndarray) -> np.ndarray:
    """[..., L] hit mask -> [...] 1 + the number of leading hits."""
    return 1 + np.cumprod(hits > 0, axis=-1).sum(-1)


def walk(per_anchor: dict[int, int]) -> list[int]:
    """The acceptance length of each cycle of greedy decoding over one sequence: start at its
    first anchor (the prompt pass's pick) and jump by each length."""
    positions = sorted(per_anchor)
    t, last, out = positions[0], positions[-1], []
    while t <= last:
        out.append(per_anchor[t])
        t += per_anchor[t]
    return out


def anchor_lengths(drafter, data: FeatureDataset, block_size: int, vocab=None, head=None,
                   anchors_per_seq: int = 64, seqs_per_batch: int = 4) -> tuple[dict[int, dict[int, int]], dict]:
    """({sequence: {anchor: acceptance length}}, summed per-position metrics) at one block size."""
    rows = eval_rows(data, anchors_per_seq)
    weights = position_weights(block_size)
    lengths: dict[int, dict[int, int]] = {}
    sums: dict[str, np.ndarray] = {}
    for j in range(0, len(rows), seqs_per_batch):
        chunk = rows[j : j + seqs_per_batch]
        batch = data.batch(chunk, block_size, anchors_per_seq)
        _, m = drafter_loss(drafter, batch, weights, LossWeights(), vocab, head, block_size=block_size)
        hits = m.pop("_hits")
        mx.eval(hits, m)
        per_anchor = acceptance_lengths(np.array(hits))
        for r, (i, anchors) in enumerate(chunk):
            lengths.setdefault(i, {}).update(zip(anchors.tolist(), per_anchor[r, : len(anchors)].tolist()))
        counts = np.array(batch.label_mask).sum(axis=(0, 1))
        for key in ("top1", "recall", "pick"):
            if key in m:
                sums[key] = sums.get(key, 0) + np.array(m[key]) * counts
        sums["count"] = sums.get("count", 0) + counts
    return lengths, sums


def simulate(drafter, data: FeatureDataset, block_sizes=(4, 8), vocab=None, head=None, anchors_per_seq: int = 64,
             seqs_per_batch: int = 4, groups: dict[int, str] | None = None) -> dict:
    """Exact simulated acceptance of `drafter` on every anchor of `data`, at each block size.

    Returns {"b4": {"tau", "tau_all", "cycles", "anchors", "accept_by_position", "top1", ...}, ...};
    with `groups` (sequence number -> name, e.g. each prompt's source) also "by_group":
    {name: {"tau", "tau_all"}}.
    """
    out = {}
    for B in block_sizes:
        lengths, sums = anchor_lengths(drafter, data, B, vocab, head, anchors_per_seq, seqs_per_batch)
        all_lengths = np.array([n for per in lengths.values() for n in per.values()])
        cycles = [n for per in lengths.values() for n in walk(per)]
        tau = sum(cycles) / max(len(cycles), 1)
        accept = [float((all_lengths > k).sum() / max((all_lengths >= k).sum(), 1)) for k in range(1, B)]
        count = np.maximum(sums.pop("count"), 1)
        out[f"b{B}"] = {"tau": round(tau, 4), "tau_all": round(float(all_lengths.mean()), 4), "cycles": len(cycles),
                        "anchors": int(len(all_lengths)), "accept_by_position": [round(a, 4) for a in accept],
                        **{k: [round(float(x), 4) for x in v / count] for k, v in sums.items()}}
        if groups:
            out[f"b{B}"]["by_group"] = _by_group(lengths, groups)
    return out


def _by_group(lengths: dict[int, dict[int, int]], groups: dict[int, str]) -> dict:
    out = {}
    for name in sorted(set(groups.values())):
        seqs = [i for i in lengths if groups.get(i) == name]
        all_lengths = [n for i in seqs for n in lengths[i].values()]
        cycles = [n for i in seqs for n in walk(lengths[i])]
        if cycles:
            out[name] = {"tau": round(sum(cycles) / len(cycles), 4),
                         "tau_all": round(sum(all_lengths) / len(all_lengths), 4), "sequences": len(seqs)}
    return out
