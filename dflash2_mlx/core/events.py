"""What decoding reports: one `CycleStats` per draft-verify cycle, one `GenerationEvent` per
cycle of a stream (with `TokenLogprob`s when asked), and a `GenerationResult` collected from
them. The single stream (`engine.py`) and the batch's rows (`batch_engine.py`) make the same."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import stats


@dataclass
class CycleStats:
    """What one draft-verify cycle did (a plain decoding step has width 1)."""

    width: int
    n_drafted: int
    n_accepted: int
    n_emitted: int
    draft_s: float
    verify_s: float
    grammar_s: float = 0.0  # computing grammar masks along the draft path (constrained decoding)


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target, and the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerationEvent:
    """Yielded by `stream_generate` once per cycle (and once for the first token).

    Attributes:
        text: new text since the last event (a tail that could start a stop string is held back).
        tokens: the tokens this event adds (EOS and anything after a stop are not included).
        cycle: the cycle that produced them (None for the first token, from the prompt pass).
        finish_reason: None while generating, then "stop" (EOS, a stop string, a completed
            grammar) or "length" (max_tokens).
        prompt_tokens: the prompt's length; prompt_tps: prompt tokens prefilled per second
            (the cached ones excluded).
        generation_tokens: tokens so far; generation_tps: their rate since the first token.
        peak_memory_gb: MLX's peak allocation (the process's peak RSS on the CPU backend).
        stop_sequence: the stop string that ended generation, if one did.
        logprobs: one `TokenLogprob` per token in `tokens`, when `top_logprobs` is set.
        cached_tokens: prompt tokens the prompt cache supplied (not prefilled).
    """

    text: str
    tokens: list[int]
    cycle: CycleStats | None
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0


@dataclass
class GenerationResult:
    """Everything `generate` measured; `cycles` holds the raw per-cycle log."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    cycles: list[CycleStats] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens a prompt cache supplied

    @property
    def speculative_cycles(self) -> list[CycleStats]:
        return stats.speculative(self.cycles)

    @property
    def tau(self) -> float:
        """Mean tokens per speculative cycle, bonus included (τ ∈ [1, block size])."""
        return stats.tau(self.cycles)

    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted), for i = 1..max drafted."""
        return stats.acceptance_by_position(self.cycles)

    def accepted_histogram(self) -> list[int]:
        """Count of speculative cycles by number of accepted drafts (index = n accepted)."""
        return stats.accepted_histogram(self.cycles)


def collect(events, on_text=None) -> GenerationResult:
    """Drain `GenerationEvent`s into a `GenerationResult`, passing new text to `on_text`."""
    text, tokens, cycles, last = [], [], [], None
    for ev in events:
        if on_text is not None and ev.text:
            on_text(ev.text)
        text.append(ev.text)
        tokens.extend(ev.tokens)
        if ev.cycle is not None:
            cycles.append(ev.cycle)
        last = ev
    return GenerationResult(
        text="".join(text), tokens=tokens, finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens, prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb, cycles=cycles,
        cached_tokens=last.cached_tokens,
    )
