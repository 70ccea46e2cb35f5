"""Sampling parameters → the target distribution p that verification must preserve.

Semantics follow `mlx_lm.sample_utils.make_sampler` so that `--drafter none` samples exactly
what `mlx_lm.generate` samples: logits processors (repetition / presence / frequency
penalties, in mlx-lm's order) on the raw logits with the token history of each position,
then log-softmax, then top-p, min-p, top-k filters on the temperature-1 log-probs, then
temperature. Temperature 0 is greedy (argmax of the processed logits).

These rules apply to the target side only; the drafter's proposal distribution q is the
selector's own (temperature only), and rejection sampling corrects for the difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ..errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens from the target. Defaults: greedy, no penalties.

    Attributes:
        temperature: 0 for greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        min_p: drop tokens below min_p x the top probability; 0 disables.
        repetition_penalty: mlx-lm's sign-aware multiplicative penalty; 1 (or 0) disables.
        presence_penalty, frequency_penalty: additive penalties; 0 disables.
        penalty_context: how many recent tokens the penalties look at.
        seed: seeds the RNG key of the run (None draws a random seed).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 20
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty < 0:
            raise ConfigError(f"repetition_penalty must be >= 0, got {self.repetition_penalty}")
        if self.penalty_context < 1:
            raise ConfigError(f"penalty_context must be >= 1, got {self.penalty_context}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def make_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the penalties in `params` (empty when none)."""
    rep = params.repetition_penalty
    return make_logits_processors(
        repetition_penalty=None if rep in (0, 1) else rep,
        repetition_context_size=params.penalty_context,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.penalty_context,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.penalty_context,
    )


def process_rows(logits: mx.array, history: list[int], block: list[int], processors: list,
                 window: int | None = None) -> mx.array:
    """Apply logits processors row by row, each row seeing the tokens before it.

    Shapes: logits [L, V]; row i follows `history + block[:i]` (block = the verify inputs
    after the anchor, i.e. the drafted tokens). `window`: the most recent tokens the
    processors read (mlx-lm's penalties look at their context size only), so a long history
    is not copied for every row.
    """
    if not processors:
        return logits
    if window is not None:
        history = history[-window:]
    rows = []
    for i in range(logits.shape[0]):
        tokens = mx.array(history + block[:i])
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """p for every row of processed logits [L, V] (float32, rows sum to 1). T must be > 0."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.softmax(logprobs * (1.0 / params.temperature), axis=-1, precise=True)
