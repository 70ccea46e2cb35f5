"""`stream_generate` and `generate`: one reply, decoded as a decoder of one row.

The reply runs on `SpeculativeBatch` (`batch_engine.py`), the decoder the server's requests
share, with that one row on its native single-row caches: the same cycle, the same pipelined
plain steps, the same events, whether a reply comes from the library, `dflash2 run` or a
server request.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import ConfigError
from .batch_engine import SpeculativeBatch
from .chat import encode_prompt
from .distributed import Lockstep
from .engine import DEFAULT_PREFILL_STEP
from .events import GenerationResult, collect
from .interfaces import Constraint, DraftModel, TargetModel, WidthPolicy
from .sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256


def stream_generate(target: TargetModel, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, *,
                    drafter: DraftModel | None = None,
                    sampling: SamplingParams | None = None, prompt_cache=None, block_size: int | None = None,
                    stop: list[str] | tuple = (), chat_template_kwargs: dict | None = None,
                    prefill_step_size: int = DEFAULT_PREFILL_STEP, block_policy: WidthPolicy | None = None,
                    kv_bits: int | None = None, kv_group_size: int | None = None, on_prefill=None,
                    pipelined: bool = True, top_logprobs: int | None = None, overlap: bool | None = None,
                    constraint: Constraint | None = None, lockstep: Lockstep | None = None):
    """Generate from `target`, speculatively when `drafter` is given; yield `GenerationEvent`s.

    Args:
        target: a `Target`.
        prompt: chat messages (`[{"role": "user", "content": ...}]`, rendered by the chat
            template, as `dflash2 run` does), raw text (tokenized with BOS as mlx-lm does), or
            token ids (a list or an mx.array); see `chat.py`.
        max_tokens: the most tokens to generate (default 256).
        drafter: a `Drafter` bound to `target`, or None (default) for plain decoding.
        sampling: `SamplingParams` (default greedy).
        chat_template_kwargs: variables for the chat template (e.g. `enable_thinking`, `tools`).
        block_size: verify width (drafts + 1); default the drafter's trained block size.
        stop: strings that end generation (not included in the text).
        prefill_step_size: prompt chunk size (default 2048).
        block_policy: optional object choosing the width of each cycle, with
            `next_width(max_width) -> int` (1 = a plain decoding step) and
            `observe(cycle: CycleStats)`; `block_size` is then the largest width.
        kv_bits: quantize the target's full-attention KV cache to 4 or 8 bits (mlx-lm's
            QuantizedKVCache; output equals plain decoding with the same quantization).
        kv_group_size: its quantization group (32, 64 or 128; default 64, or 32 where 64
            does not divide the head dimension).
        on_prefill: optional `(n_done, n_total) -> bool | None`, called before each prompt
            chunk; returning False cancels: the generator ends without yielding anything.
        pipelined: plain steps (without penalties) queue the next step before reading the last
            token back, as mlx-lm does; False runs the one-step-at-a-time twin.
        overlap: build the verify graph while the drafts compute (default: on GPU backends; on
            the CPU backend host work and kernels share the same cores, so it does not pay).
        top_logprobs: when set, each event carries `logprobs`: every token's log-probability
            under the target (from the verify rows, so equal to plain decoding's) and this
            many most likely alternatives (0 for none).
        constraint: a `Constraint` (fresh: a `GrammarConstraint` at its grammar's start, a
            `ThinkingBudget`): every target row is masked by its state along the draft path, so
            the output equals constrained plain decoding; generation ends when it is complete.
        prompt_cache: a `PromptCache` for this target and drafter: generation starts from the
            longest prefix of the prompt it reaches exactly and leaves it covering prompt and
            reply (events report `cached_tokens`). Output equals a cold run's.
        lockstep: a `distributed.Lockstep` when `target` is sharded over launched processes:
            every rank calls this with the same prompt; rank 0 passes the drafter, the others
            none, and rank 0's width and limit hold for all (see `distributed.py`).
    """
    if prompt is None or hasattr(prompt, "draft"):
        raise TypeError("stream_generate(target, prompt, max_tokens, *, drafter=...): the drafter is a "
                        "keyword argument (it was the second positional one before the v2 API)")
    ids = encode_prompt(target.tokenizer, prompt, chat_template_kwargs=chat_template_kwargs)
    decoder, row = single_row(target, ids, max_tokens, drafter=drafter, sampling=sampling, prompt_cache=prompt_cache,
                              block_size=block_size, stop=stop, prefill_step_size=prefill_step_size,
                              block_policy=block_policy, kv_bits=kv_bits, kv_group_size=kv_group_size,
                              on_prefill=on_prefill, pipelined=pipelined, top_logprobs=top_logprobs, overlap=overlap,
                              constraint=constraint, lockstep=lockstep)
    return _events(decoder, row, prompt_cache)


def single_row(target: TargetModel, ids: list[int], max_tokens: int, *, drafter: DraftModel | None = None,
               sampling: SamplingParams | None = None, prompt_cache=None, block_size: int | None = None, stop=(),
               prefill_step_size: int = DEFAULT_PREFILL_STEP, block_policy: WidthPolicy | None = None,
               kv_bits: int | None = None, kv_group_size: int | None = None, on_prefill=None, pipelined: bool = True,
               top_logprobs: int | None = None, overlap: bool | None = None, constraint: Constraint | None = None,
               lockstep: Lockstep | None = None) -> tuple[SpeculativeBatch, int]:
    """A decoder holding one row for the prompt `ids` (token ids), and the row's id: what
    `stream_generate` steps, and the server's worker for a reply that decodes on its own.
    Arguments as `stream_generate`'s; sharded (`lockstep`), every rank agrees on rank 0's
    width and token limit first."""
    width = block_size or (drafter.config.block_size if drafter is not None else 1)
    if lockstep is not None:
        width, max_tokens = _agree(lockstep, ids, width if drafter is not None else 1, max_tokens, prompt_cache)
    decoder = SpeculativeBatch(target, drafter, block_size=width, alone_policy=block_policy,
                               prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
                               overlap=overlap, pipelined=pipelined, lockstep=lockstep)
    row = decoder.add(ids, max_tokens, sampling=sampling, stop=stop, top_logprobs=top_logprobs,
                      constraint=constraint, prompt_cache=prompt_cache, on_prefill=on_prefill)
    return decoder, row


def _events(decoder: SpeculativeBatch, row: int, prompt_cache):
    """The row's events until it ends; its error is raised here. Closed at an event, the row
    leaves and its prompt cache keeps what its caches cover (the prompt and the reply so far);
    cut inside a step (an interrupt), what they cover is unknown: the prompt cache is reset."""
    mx.reset_peak_memory()
    try:
        while len(decoder):
            yield from (event for _, event in decoder.step())
            for _, error in decoder.take_failures():
                raise error  # the row has left; its prompt cache is reset
    except GeneratorExit:
        raise
    except BaseException:
        decoder.remove(row)
        if prompt_cache is not None:
            prompt_cache.reset()
        raise
    finally:
        decoder.remove(row)


def _agree(lockstep: Lockstep, ids: list[int], width: int, max_tokens: int, prompt_cache) -> tuple[int, int]:
    """Rank 0's widest block and token limit for every rank (its policy, if any, picks each
    cycle's width from there); a different prompt length is refused."""
    if prompt_cache is not None:
        raise ConfigError("a sharded target decodes without a prompt cache")
    width_0, max_tokens_0, n_ids_0 = lockstep.share(mx.array([width, max_tokens, len(ids)])).tolist()
    if n_ids_0 != len(ids):
        raise ConfigError(f"rank {lockstep.rank} has a prompt of {len(ids)} tokens, rank 0 one of {n_ids_0}")
    return width_0, max_tokens_0


def generate(target, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end and collect a `GenerationResult` (same arguments)."""
    return collect(stream_generate(target, prompt, max_tokens, **kwargs))
