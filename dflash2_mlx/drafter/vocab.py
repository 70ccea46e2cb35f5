"""The compact proposal vocabulary: draft only among the most frequent token ids.

The drafter's head is the target's LM head, `[V, H]`, read once per proposal; for a small
target it is the largest share of a drafter pass. A proposal vocabulary keeps the rows of the
`size` most frequent ids (ranked offline) and drafts over those only. Verification still uses
the target's full head, so output stays exact: greedy verification compares tokens, and at
T > 0 the selector's q is a softmax over candidates drawn from the subset, so it is a proper
distribution whose support is the subset (ids outside it have q = 0, which rejection sampling
handles exactly).

File: `proposal_vocab.json` next to the drafter's `config.json`, holding the ranked ids (most
frequent first), the default size and where the counts came from (`write_vocab_file`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError

FILE_NAME = "proposal_vocab.json"
FORMAT = "dflash2-proposal-vocab"
COVERAGE_SIZES = (2048, 4096, 8192, 12288, 16384, 24576, 32768)


@dataclass(frozen=True)
class ProposalVocab:
    """Ranked ids of a proposal vocabulary and the active size.

    ranked: every id the file ranks, most frequent first; `ids` are its first `size` entries,
    sorted ascending so an argmax over the subset breaks ties like one over the full vocab.
    """

    ranked: tuple[int, ...]
    vocab_size: int
    size: int
    default_size: int
    source: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)
    path: str | None = None

    @property
    def ids(self) -> mx.array:
        return mx.array(sorted(self.ranked[: self.size]), dtype=mx.int32)

    def resized(self, size: int) -> "ProposalVocab":
        if not 1 <= size <= len(self.ranked):
            raise ConfigError(f"draft vocab size must be in 1..{len(self.ranked)} (the ids ranked in "
                              f"{self.path or 'this vocab'}), got {size}")
        return ProposalVocab(self.ranked, self.vocab_size, size, self.default_size, self.source, self.coverage,
                             self.path)

    def describe(self) -> dict:
        """What `doctor` and `--json` show."""
        cov = self.coverage.get(str(self.size))
        return {"size": self.size, "vocab_size": self.vocab_size, "ranked": len(self.ranked),
                "path": self.path, "source": self.source, "coverage": cov}


# -- reading and writing ----------------------------------------------------------------------


def read_vocab_file(path: str | Path) -> ProposalVocab:
    """Parse a `proposal_vocab.json` (at its default size); ConfigError when malformed."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read proposal vocab {path}: {e}") from e
    if raw.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a proposal vocab (format {raw.get('format')!r}, expected {FORMAT!r})")
    ranked, V = raw.get("ranked_ids"), raw.get("vocab_size")
    if not isinstance(ranked, list) or not ranked or not isinstance(V, int):
        raise ConfigError(f"{path} needs a non-empty 'ranked_ids' list and an integer 'vocab_size'")
    if len(set(ranked)) != len(ranked) or min(ranked) < 0 or max(ranked) >= V:
        raise ConfigError(f"{path}: 'ranked_ids' must be distinct ids in 0..{V - 1}")
    default = int(raw.get("default_size") or len(ranked))
    vocab = ProposalVocab(tuple(int(i) for i in ranked), V, len(ranked), default, raw.get("source", {}),
                          raw.get("coverage", {}), str(path))
    return vocab.resized(min(default, len(ranked)))


def find_vocab_file(drafter_dir: str | Path) -> Path | None:
    path = Path(drafter_dir) / FILE_NAME
    return path if path.is_file() else None


def resolve_vocab(drafter_dir, vocab_size: int, size: int | None) -> ProposalVocab | None:
    """The proposal vocab a drafter loads with: the shipped file at `size` (None: the file's
    default; 0 or >= vocab_size: off, the full head)."""
    path = find_vocab_file(drafter_dir) if drafter_dir is not None else None
    if size == 0 or (size is not None and size >= vocab_size):
        return None
    if path is None:
        if size is not None:
            raise ConfigError(f"--draft-vocab {size} needs a {FILE_NAME} next to the drafter (none in "
                              f"{drafter_dir}); build one with `dflash2 train draft-vocab`")
        return None
    vocab = read_vocab_file(path)
    if vocab.vocab_size != vocab_size:
        raise ConfigError(f"{path} ranks a vocab of {vocab.vocab_size} ids, the drafter has {vocab_size}")
    return vocab if size is None else vocab.resized(size)


def write_vocab_file(path: str | Path, counts: np.ndarray, keep: int, default_size: int, source: dict,
                     always: Iterable[int] = (), heldout: np.ndarray | None = None) -> Path:
    """Rank ids by `counts` (ties: lower id first), keep the top `keep` and write the file.

    `always` (e.g. EOS ids) rank first whatever their counts. Coverage per size is measured
    on `heldout` counts when given (else on `counts` themselves).
    """
    ranked = rank_ids(counts, always)[:keep]
    ref = counts if heldout is None else heldout
    total = max(int(ref.sum()), 1)
    order = ref[np.array(ranked)]
    coverage = {str(n): round(float(order[:n].sum()) / total, 5) for n in COVERAGE_SIZES if n <= len(ranked)}
    coverage[str(len(ranked))] = round(float(order.sum()) / total, 5)
    doc = {"format": FORMAT, "version": 1, "vocab_size": int(len(counts)), "default_size": int(default_size),
           "source": {**source, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                      "coverage_measured_on": "held-out counts" if heldout is not None else "the counted tokens"},
           "coverage": coverage, "ranked_ids": [int(i) for i in ranked]}
    path = Path(path)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return path


# -- counting and ranking ----------------------------------------------------------------------


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """How often each id occurs in `sequences` -> int64 [vocab_size]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        ids = np.asarray(list(seq), dtype=np.int64)
        if ids.size:
            counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def rank_ids(counts: np.ndarray, always: Iterable[int] = ()) -> list[int]:
    """Ids by descending count (stable: ties keep ascending id order), `always` first."""
    first = [int(i) for i in dict.fromkeys(always) if 0 <= int(i) < len(counts)]
    order = np.argsort(-counts, kind="stable")
    seen = set(first)
    return first + [int(i) for i in order if int(i) not in seen]


# -- the compact head ------------------------------------------------------------------------


def head_rows(target, ids: mx.array | None, bits: int | None = None, group_size: int = 64) -> nn.Module:
    """A private head over the target head's rows `ids` (all rows when None), optionally
    `bits`-bit; rows of an already quantized head are gathered with their own scales."""
    dense = target.dense_head_weight
    if dense is None:
        if ids is None:
            raise ConfigError("the target's head is already quantized; no private copy is needed")
        return _quantized_rows(target.quantized_head, ids)
    head = nn.Linear(dense.shape[1], dense.shape[0] if ids is None else ids.size, bias=False)
    head.weight = dense if ids is None else dense[ids]
    if bits:
        head = nn.QuantizedLinear.from_linear(head, group_size, bits)
    mx.eval(head.parameters())  # materialise the gathered rows once, not per call
    return head


def _quantized_rows(module: nn.Module, ids: mx.array) -> nn.Module:
    # Affine/fp quantization groups run along the input dimension, so each row is self-contained.
    rows = nn.QuantizedLinear(module.weight.shape[1] * 32 // module.bits, ids.size, bias=False,
                              group_size=module.group_size, bits=module.bits, mode=getattr(module, "mode", "affine"))
    rows.weight, rows.scales = module.weight[ids], module.scales[ids]
    if "biases" in module:
        rows.biases = module.biases[ids]
    elif "biases" in rows:
        del rows["biases"]
    mx.eval(rows.parameters())
    return rows
