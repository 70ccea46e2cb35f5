"""A loaded model pair ready to generate: what the CLI, the server and the bench share.

`Session.open(model, drafter=...)` resolves names through `hub.resolve` (aliases, local
directories, HF repos, GGUF files, the built-in demo pair), loads the target and the drafter,
and applies the registry's defaults (block size, drafter bits, dtype). `Session.generate`
applies the chat template and runs the engine; `result_to_json` and `render_stats_line` are
the two ways results are shown.
"""

from __future__ import annotations

import time
from dataclasses import InitVar, dataclass, field
from typing import Callable

from .core.chat import encode_prompt
from .core.distributed import Lockstep
from .core.events import GenerationResult, collect
from .core.generate import stream_generate
from .core.interfaces import DraftModel, TargetModel
from .core.sampling import SamplingParams
from .errors import ConfigError


def parse_block_size(value) -> int | str | None:
    """None, an int >= 2, or 'auto' (from the CLI's string)."""
    if value is None or value == "auto":
        return value
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--block-size must be an integer >= 2 or 'auto', got {value!r}") from None
    if size < 2:
        raise ConfigError(f"--block-size must be an integer >= 2 or 'auto', got {size}")
    return size


@dataclass
class Session:
    """`block_size` (an int, "auto" or None: the drafter's trained size) is resolved once into
    `width`, the widest verify block (1 without a drafter), and `adaptive`, whether a policy
    picks each cycle's width up to it; nothing downstream reads the raw value again."""

    spec: object  # hub.ModelSpec, or a stand-in with its fields
    target: TargetModel
    drafter: DraftModel | None
    block_size: InitVar[int | str | None]
    notes: list[str] = field(default_factory=list)
    kv_bits: int | None = None  # the target's full-attention K/V quantized (every cache this session makes)
    kv_group_size: int | None = None
    lockstep: Lockstep | None = None  # set when launched sharded over processes
    _policy: object | None = None  # one adaptive policy per session: it keeps learning across requests
    width: int = field(init=False)
    adaptive: bool = field(init=False)

    def __post_init__(self, block_size) -> None:
        size = parse_block_size(block_size)
        self.adaptive = self.drafter is not None and size == "auto"
        if self.drafter is None:
            self.width = 1
        else:
            self.width = size if isinstance(size, int) else self.drafter.config.block_size

    @classmethod
    def open(cls, model: str | None = None, drafter: str | None = None, draft_bits: int | None = None,
             block_size=None, progress: bool = True, dtype: str | None = None,
             draft_vocab: int | None = None, kv_bits: int | None = None,
             kv_group_size: int | None = None, distributed: bool = True, shard: str = "tensor") -> "Session":
        from . import hub
        from .core.distributed import agree_taps, launched
        from .drafter.load import load_drafter
        from .target import load_target

        lockstep = launched(shard) if distributed else None
        spec = hub.resolve(model, drafter, progress=progress and (lockstep is None or lockstep.leader))
        defaults = dict(spec.defaults)
        target = load_target(spec.target, dtype=dtype or defaults.get("dtype"), lockstep=lockstep)
        bits = draft_bits if draft_bits is not None else defaults.get("draft_bits")
        draft = None
        if spec.drafter is not None and (lockstep is None or lockstep.leader):  # rank 0 alone drafts
            vocab = draft_vocab if draft_vocab is not None else defaults.get("draft_vocab")
            draft = load_drafter(spec.drafter, target, draft_bits=bits, head_bits=defaults.get("draft_head_bits"),
                                 draft_vocab=vocab)
        if lockstep is not None:
            agree_taps(lockstep, target, tuple(draft.config.target_layer_ids) if draft is not None else ())
        size = parse_block_size(block_size if block_size is not None else defaults.get("block_size"))
        notes = list(spec.notes)
        if lockstep is None and shard != "tensor":
            notes.append(f"--shard {shard} applies under mlx.launch only: this process holds the whole target")
        if kv_bits is not None or kv_group_size is not None:
            target.make_cache(kv_bits=kv_bits, kv_group_size=kv_group_size)  # refuse a bad combination now
            kv_group_size = target.kv_group_size(kv_bits, kv_group_size)
        session = cls(spec=spec, target=target, drafter=draft, block_size=size, notes=notes,
                      kv_bits=kv_bits, kv_group_size=kv_group_size, lockstep=lockstep)
        if lockstep is not None and size == "auto" and spec.drafter is not None:
            session._agree_policy()
        return session

    def _agree_policy(self) -> None:
        """Sharded `--block-size auto`: every rank takes part in the calibration's passes (at
        load, in lockstep); rank 0's policy picks each cycle's width for all of them."""
        from .core.block_policy import AdaptiveBlockPolicy
        from .core.calibration import agree_calibration

        cal = agree_calibration(self.lockstep, self.target, self.drafter)
        if cal is not None:
            self._policy = AdaptiveBlockPolicy(cal.costs)
            self.notes.append(f"block size auto over {self.lockstep.size} ranks: widths measured in the sharded "
                              "setting; rank 0 picks each cycle's width for every rank")

    # -- prompts ------------------------------------------------------------------------

    def encode(self, prompt, system: str | None = None, raw: bool = False, think: bool | None = None,
               template: dict | None = None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages; `template` holds more
        chat-template variables (`think` is `enable_thinking`)."""
        tok = self.target.tokenizer
        # Raw text as asked, or for a model without a template (mlx-lm's way) unless a system
        # prompt must go in: then the plain transcript carries it.
        if isinstance(prompt, str) and (raw or not (getattr(tok, "chat_template", None) or system)):
            return encode_prompt(tok, prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        kwargs = dict(template or {})
        if think is not None:
            kwargs["enable_thinking"] = think
        return encode_prompt(tok, messages, system=system, chat_template_kwargs=kwargs)

    def sampling(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **kw)

    @property
    def policy(self):
        """The adaptive block policy once made (`block_size == "auto"`), else None."""
        return self._policy

    # -- generation ---------------------------------------------------------------------

    def prepare(self, progress=None) -> str | None:
        """The one-time work before the first generation, done now rather than inside it: for
        `--block-size auto`, this machine's cost calibration (measured once, then cached).
        Returns a line saying what the policy starts from, or None when there is nothing to do."""
        if not self.adaptive or self._policy is not None:
            return None
        from .core.calibration import auto_policy

        t0 = time.perf_counter()
        self._policy = auto_policy(self.target, self.drafter, progress=progress)
        costs, seconds = self._policy.costs, time.perf_counter() - t0
        ratios = " ".join(f"{costs.cycle_s(w) / costs.cycle_s(1):.2f}" for w in range(2, costs.max_width + 1))
        verdict = "can" if self._policy.can_ever_win(costs.max_width) else "cannot"
        return (f"block size auto: calibration ready in {seconds:.1f} s; a cycle of width 2..{costs.max_width} "
                f"costs {ratios} plain steps here, so speculation {verdict} beat plain decoding; the width "
                "follows the measured acceptance, down to plain decoding when drafts do not pay")

    def speculation(self, sampling: SamplingParams | None = None):
        """(block size, width policy or None) for a reply decoding on its own with `sampling`."""
        if self.drafter is None:  # plain decoding (a sharded target's other ranks get rank 0's width)
            return None, None
        if not self.adaptive or (sampling is not None and sampling.seed is not None and not sampling.greedy):
            # the policy's widths follow wall-clock timings, and each width draws the RNG its own
            # way: a seeded sampled request decodes at the full width so that it repeats
            return self.width, None
        from .core.calibration import auto_policy

        self._policy = self._policy or auto_policy(self.target, self.drafter)
        return self.width, self._policy

    def prompt_cache(self):
        """An empty `PromptCache` for this pair, wide enough for its verify blocks."""
        from .core.prompt_cache import DEFAULT_RESERVE, PromptCache

        return PromptCache(self.target, self.drafter, reserve=max(DEFAULT_RESERVE, self.width), kv_bits=self.kv_bits,
                           kv_group_size=self.kv_group_size)

    def stream(self, prompt, sampling: SamplingParams | None = None, max_tokens: int = 256, stop=(),
               system: str | None = None, raw: bool = False, think: bool | None = None, **engine):
        """Engine events for a prompt; `engine` passes on to `stream_generate` (e.g. `on_prefill`)."""
        ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) \
            else self.encode(prompt, system=system, raw=raw, think=think)
        width, policy = self.speculation(sampling)
        engine = {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size, "lockstep": self.lockstep} | engine
        return stream_generate(self.target, ids, max_tokens, drafter=self.drafter, sampling=sampling,
                               block_size=width, stop=stop, block_policy=policy, **engine)

    def generate(self, prompt, sampling: SamplingParams | None = None, max_tokens: int = 256, stop=(),
                 on_text: Callable[[str], None] | None = None, **template) -> GenerationResult:
        events = self.stream(prompt, sampling=sampling, max_tokens=max_tokens, stop=stop, **template)
        return collect(events, on_text)

    def describe(self) -> str:
        draft = "no drafter (plain decoding)" if self.drafter is None else f"drafter {self.spec.drafter}"
        kv = f", {self.kv_bits}-bit K/V (groups of {self.kv_group_size})" if self.kv_bits else ""
        if self.lockstep is not None:
            d = self.lockstep.describe()
            how = "tensor parallel" if d["mode"] == "tensor" else "pipeline stages"
            kv += f", target sharded over {d['size']} ranks ({d['backend']}, {how}; drafter on rank 0)"
        return f"{self.spec.name}: target {self.spec.target}, {draft}{kv}"


def result_to_json(session: Session, result: GenerationResult) -> dict:
    """The `--json` object of `dflash2 run`."""
    spec = result.speculative_cycles
    return {
        "model": session.spec.name,
        "target": str(session.spec.target),
        "drafter": None if session.drafter is None else str(session.spec.drafter),
        "notes": session.notes,
        "kv_bits": session.kv_bits,
        "kv_group_size": session.kv_group_size,
        "distributed": session.lockstep.describe() if session.lockstep is not None else None,
        "text": result.text,
        "token_ids": result.tokens,
        "n_tokens": len(result.tokens),
        "finish_reason": result.finish_reason,
        "tau": result.tau,
        "cycles": len(result.cycles),
        "speculative_cycles": len(spec),
        "acceptance_by_position": result.acceptance_by_position(),
        "accepted_histogram": result.accepted_histogram(),
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "prompt_tps": result.prompt_tps,
        "decode_tps": result.generation_tps,
        "peak_memory_gb": result.peak_memory_gb,
    }


def render_stats_line(session: Session, result: GenerationResult) -> str:
    """One line after a plain `dflash2 run`: speed, τ and acceptance by block position."""
    parts = [f"{len(result.tokens)} tokens", f"{result.generation_tps:.1f} tok/s",
             f"prompt {result.prompt_tps:.0f} tok/s"]
    if result.cached_tokens:
        parts.append(f"{result.cached_tokens} of {result.prompt_tokens} prompt tokens cached")
    if session.drafter is None:
        parts.append("plain decoding (no drafter)")
    else:
        by_pos = " ".join(f"{a:.2f}" for a in result.acceptance_by_position())
        parts.append(f"τ {result.tau:.2f}")
        parts.append(f"accept by position [{by_pos}]")
    parts.append(f"peak {result.peak_memory_gb:.2f} GB")
    line = " · ".join(parts)
    return "\n".join([line] + [f"note: {n}" for n in session.notes])
