"""Selector codebooks tied to the target's embedding while training.

A free [V, r] codebook row trains only when its token is seen, so with little data most rows
stay at their random init and add noise to every pair score (drafter-recipe.md §2.2). Tied,
a codebook is `E · P + R`: E the target's frozen embedding [V, H_t], P [H_t, r] a learned
projection shared by all tokens (initialised from E's principal directions), R a per-token
residual that starts at zero. Every update then moves similar tokens together, and rare
tokens get a meaningful row for free.

Only training sees this form: `materialize` turns the selector back into plain [V, r]
codebooks, the published layout, so inference and export are unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


class TiedCodebook(nn.Module):
    """rows(ids) = E[ids] · P + R[ids]; `weight` is the materialized [V, r] table."""

    def __init__(self, embed_weight: mx.array, projection: mx.array, residual: bool = True):
        super().__init__()
        self._embed = mx.stop_gradient(embed_weight)  # underscore: not a parameter
        self.projection = projection
        if residual:
            self.residual = mx.zeros((embed_weight.shape[0], projection.shape[1]), dtype=projection.dtype)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self._embed[ids].astype(self.projection.dtype) @ self.projection
        return rows + self.residual[ids] if "residual" in self else rows

    @property
    def weight(self) -> mx.array:
        table = self._embed.astype(self.projection.dtype) @ self.projection
        return table + self.residual if "residual" in self else table


def pca_projection(embed_weight: mx.array, rank: int, row_rms: float = 0.125, rows: int = 16384) -> mx.array:
    """[H_t, r]: E's top `rank` principal directions (of its first `rows` rows), scaled so that
    projected rows have about the rms of MLX's default embedding init."""
    e = np.asarray(embed_weight[:rows].astype(mx.float32))
    e = e - e.mean(axis=0, keepdims=True)
    _, _, vt = np.linalg.svd(e, full_matrices=False)
    p = vt[:rank].T  # [H_t, r]
    scale = row_rms / max(float(np.sqrt(((e @ p) ** 2).mean())), 1e-12)
    return mx.array((p * scale).astype(np.float32))


def tie(selector, embed_weight: mx.array, residual: bool = True) -> None:
    """Replace the selector's codebooks with tied ones (both start from the same projection)."""
    rank = selector.hidden_projection.weight.shape[0]
    proj = pca_projection(embed_weight, rank)
    for name in CODEBOOKS:
        setattr(selector, name, TiedCodebook(embed_weight, proj, residual))


def is_tied(selector) -> bool:
    return isinstance(getattr(selector, CODEBOOKS[0]), TiedCodebook)


def materialize(selector) -> None:
    """Turn tied codebooks into plain `nn.Embedding` tables (the published layout)."""
    for name in CODEBOOKS:
        book = getattr(selector, name)
        if isinstance(book, TiedCodebook):
            table = nn.Embedding(*book.weight.shape)
            table.weight = book.weight
            setattr(selector, name, table)


def tied_state(selector) -> dict[str, mx.array]:
    """The trainable arrays of tied codebooks, for a checkpoint."""
    return {f"{name}.{k}": v for name in CODEBOOKS for k, v in getattr(selector, name).parameters().items()}


def load_tied_state(selector, embed_weight: mx.array, state: dict[str, mx.array]) -> None:
    """Re-tie the selector from `tied_state`'s arrays (a resumed run)."""
    for name in CODEBOOKS:
        book = TiedCodebook(embed_weight, state[f"{name}.projection"], f"{name}.residual" in state)
        if f"{name}.residual" in state:
            book.residual = state[f"{name}.residual"]
        setattr(selector, name, book)
