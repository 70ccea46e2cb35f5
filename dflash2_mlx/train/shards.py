"""Feature shards: training sequences with the target's labels, soft labels and tapped states.

A shard is one safetensors file. It is read memory-mapped (`FeatureShard.load`), so a data set
can be larger than RAM: a batch copies only the rows it uses.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..paths import atomic_path

_DTYPES = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "U8": np.uint8,
           "U16": np.uint16, "I16": np.int16, "F64": np.float64}


def mmap_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy memmap (no copy into RAM)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}, which shards do not use")
        start, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if end == start:
            out[name] = np.zeros(shape, dtype=_DTYPES[meta["dtype"]])
            continue
        out[name] = np.memmap(path, dtype=_DTYPES[meta["dtype"]], mode="r", offset=8 + n + start, shape=shape)
    return out


@dataclass
class FeatureShard:
    """One shard of training sequences: tokens, labels, where anchors may go, tapped states.

    `labels[i]` is the target's pick after tokens[:i+1] (its next token); `anchor_ok[i]` is 1
    where a block may start (response / assistant tokens). `top_ids` / `top_logprobs` hold the
    target's k best next tokens and their log-probs where it was asked (-inf elsewhere). Shards
    written before labels were stored derive them: the next token, and anchors from
    `response_start` on.
    """

    tokens: np.ndarray  # [N] int32, all sequences concatenated
    offsets: np.ndarray  # [n_seq + 1] int64, sequence i is tokens[offsets[i]:offsets[i+1]]
    response_start: np.ndarray  # [n_seq] int32, index (within the sequence) of the first trainable token
    hidden: np.ndarray  # [N, n_taps * H] float16
    labels: np.ndarray | None = None  # [N] int32
    anchor_ok: np.ndarray | None = None  # [N] uint8
    top_ids: np.ndarray | None = None  # [N, k] int32
    top_logprobs: np.ndarray | None = None  # [N, k] float16, -inf where no soft label was stored
    prompt_index: np.ndarray | None = None  # [n_seq] int32, each sequence's prompt in its run (on-policy data)

    def __post_init__(self):
        if self.labels is None:
            self.labels = np.concatenate([self.tokens[1:], self.tokens[-1:]]).astype(np.int32)
        if self.anchor_ok is None:
            ok = np.zeros(len(self.tokens), dtype=np.uint8)
            for i in range(len(self)):
                ok[self.offsets[i] + self.response_start[i] : self.offsets[i + 1]] = 1
            self.anchor_ok = ok

    @classmethod
    def load(cls, path: Path) -> "FeatureShard":
        arrays = mmap_safetensors(Path(path))
        fields = [arrays[k] for k in ("tokens", "offsets", "response_start", "hidden")]
        extra = [arrays.get(k) for k in ("labels", "anchor_ok", "top_ids", "top_logprobs", "prompt_index")]
        return cls(*fields, *extra)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def top_k(self) -> int:
        return 0 if self.top_ids is None else int(self.top_ids.shape[1])


class ShardWriter:
    """Collects sequences (tokens, labels, trainable mask, states, soft labels) into one shard file."""

    def __init__(self, width: int, top_k: int = 0):
        self.width, self.top_k = width, top_k
        self.tokens: list[int] = []
        self.ok: list[int] = []
        self.offsets, self.starts = [0], []
        self.labels: list[np.ndarray] = []
        self.hidden: list[np.ndarray] = []
        self.top_ids: list[np.ndarray] = []
        self.top_lp: list[np.ndarray] = []
        self.prompt_index: list[int] = []

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, seq: list[int], labels, trainable: list[int], hidden, top_ids=None, top_logprobs=None,
            prompt_index: int | None = None) -> None:
        """One sequence; `top_ids` / `top_logprobs` [len(seq), k] (-inf rows: none), needed when top_k > 0;
        `prompt_index`: its prompt's number in an on-policy run (all or none of a shard's sequences)."""
        if prompt_index is not None:
            self.prompt_index.append(prompt_index)
        n = len(seq)
        self.tokens.extend(seq)
        self.labels.append(np.asarray(labels, dtype=np.int32).reshape(n))
        self.ok.extend(trainable)
        self.offsets.append(len(self.tokens))
        self.starts.append(trainable.index(1) if 1 in trainable else n)
        self.hidden.append(np.asarray(hidden, dtype=np.float16).reshape(n, self.width))
        if self.top_k:
            if top_ids is None or top_logprobs is None:
                raise ValueError(f"this writer stores top-{self.top_k} soft labels; the sequence has none")
            self.top_ids.append(np.asarray(top_ids, dtype=np.int32).reshape(n, self.top_k))
            self.top_lp.append(np.asarray(top_logprobs, dtype=np.float16).reshape(n, self.top_k))

    def write(self, path: Path) -> None:
        def cat(parts, shape, dtype):
            return mx.array(np.concatenate(parts) if parts else np.zeros(shape, dtype))

        arrays = {
            "tokens": mx.array(np.asarray(self.tokens, dtype=np.int32)),
            "offsets": mx.array(np.asarray(self.offsets, dtype=np.int64)),
            "response_start": mx.array(np.asarray(self.starts, dtype=np.int32)),
            "labels": cat(self.labels, (0,), np.int32),
            "anchor_ok": mx.array(np.asarray(self.ok, dtype=np.uint8)),
            "hidden": cat(self.hidden, (0, self.width), np.float16),
        }
        if self.prompt_index:
            if len(self.prompt_index) != len(self.starts):
                raise ValueError("prompt_index was given for some sequences of this shard but not all")
            arrays["prompt_index"] = mx.array(np.asarray(self.prompt_index, dtype=np.int32))
        if self.top_k:
            arrays["top_ids"] = cat(self.top_ids, (0, self.top_k), np.int32)
            arrays["top_logprobs"] = cat(self.top_lp, (0, self.top_k), np.float16)
        with atomic_path(path) as tmp:
            mx.save_safetensors(str(tmp), arrays)


def pad_soft_rows(n_before: int, top_ids: np.ndarray, top_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Soft labels for a whole sequence from those of its last rows: `n_before` empty rows first."""
    k = top_ids.shape[1]
    ids = np.concatenate([np.zeros((n_before, k), np.int32), top_ids.astype(np.int32)])
    lps = np.concatenate([np.full((n_before, k), -np.inf, np.float16), top_logprobs.astype(np.float16)])
    return ids, lps
