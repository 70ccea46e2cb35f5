"""The target model: any mlx-lm language model seen through what speculation needs.

`Target` adds to an mlx-lm model and tokenizer:
* hidden-state taps: the output (residual stream) of any decoder layer, per position;
* the embedding with the model's own input scale and the LM head (untied, tied, or
  under `language_model`), with the model's logit transforms;
* caches that roll back exactly (`caches.py`, `recurrent.py`) and `commit`, which keeps a
  prefix of the last verify block.

The model's forward code is mlx-lm's; layers are wrapped, never patched. At construction a
short probe checks that our head reproduces `model(x)` and measures the embedding scale from
the real layer-0 input, so a family with unusual logit code falls back to the full forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .core.cache_kinds import kind_of
from .core.caches import adapt_cache
from .core.kv_attention import attention_view
from .core.recurrent import _Wrapper, install_replay, replay_layers
from .errors import ConfigError, DFlashError

log = logging.getLogger(__name__)

_PROBE_IDS = (1, 17, 42, 99, 7, 3)


class _TapSink:
    """Where armed taps write layer outputs during one forward call."""

    def __init__(self, fast_replay: bool):
        self.wanted: frozenset[int] = frozenset()
        self.outputs: dict[int, mx.array] = {}
        self.layer0_input: mx.array | None = None
        self.want_input = False
        self.fast_replay = fast_replay  # how the recurrent layers under these taps were wrapped


class HiddenTap(_Wrapper):
    """Wraps decoder layer `index`; stores its output when the sink asks for it."""

    def __init__(self, inner: nn.Module, index: int, sink: _TapSink):
        super().__init__(inner)
        self.index = index
        self.sink = sink

    def __call__(self, x, *args, **kwargs):
        if self.index == 0 and self.sink.want_input:
            self.sink.layer0_input = x
        out = self.inner(x, *args, **kwargs)
        if self.index in self.sink.wanted:
            self.sink.outputs[self.index] = out[0] if isinstance(out, tuple) else out
        return out


def _inner_model(model: nn.Module) -> nn.Module:
    for candidate in (getattr(model, "model", None), _get(model, "language_model", "model")):
        if candidate is not None and hasattr(candidate, "layers") and hasattr(candidate, "embed_tokens"):
            return candidate
    raise ConfigError(f"cannot find the decoder (embed_tokens + layers) in {type(model).__name__}")


def _get(obj, *names):
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _model_args(model: nn.Module):
    return _get(model, "language_model", "args") or getattr(model, "args", None)


def _resolve_head(model: nn.Module, inner: nn.Module):
    head = getattr(model, "lm_head", None) or _get(model, "language_model", "lm_head")
    if isinstance(head, nn.Module):
        return head
    return inner.embed_tokens.as_linear


def _logit_transform(args):
    """The logit post-processing that mlx-lm families apply after the head."""
    cap = getattr(args, "final_logit_softcapping", None)
    scale = getattr(args, "logit_scale", None)
    divisor = getattr(args, "logits_scaling", None)

    def transform(logits):
        if scale:
            logits = logits * scale
        if divisor:
            logits = logits / divisor
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    return transform


@dataclass
class TargetInfo:
    """Static facts about a target, for drafter validation and `doctor`."""

    model_type: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    embed_scale: float | None
    head_matches_model: bool
    recurrent_layers: tuple[int, ...] = field(default_factory=tuple)


class Target:
    """An mlx-lm model + tokenizer prepared for speculative decoding.

    Args:
        model: an mlx-lm `Model` (any family).
        tokenizer: its `TokenizerWrapper`.
        path: where it was loaded from (for messages and the registry).
        fast_recurrent_replay: use the GatedDeltaNet fast replay where it applies
            (default True); False forces the generic replay (tests compare the two).
        stacked_replay: roll back all same-shape GatedDeltaNet layers as one stacked
            update (default True); False replays each layer on its own (the slow twin).
    """

    def __init__(self, model: nn.Module, tokenizer, path: str | None = None,
                 fast_recurrent_replay: bool = True, stacked_replay: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.inner = _inner_model(model)
        self.args = _model_args(model)
        self._sink = _TapSink(fast_recurrent_replay)
        self._head = _resolve_head(model, self.inner)
        self._transform = _logit_transform(self.args)
        self._replayers: dict[int, nn.Module] = {}  # by the layer's place in the caches
        self.stacked_replay = stacked_replay
        # Pipelined, every forward gathers these taps from the stages that hold them, on every
        # rank alike (rank 0's drafter's ids, agreed once: `distributed.agree_taps`).
        self.pipeline_taps: tuple[int, ...] = ()
        # fixed once the model is loaded (`pipeline(group)` runs before this), read on every forward
        self._pipelined = getattr(self.inner, "pipeline_size", 1) > 1
        self._wrap_layers(fast_recurrent_replay)
        self.info = self._probe()

    # -- construction ---------------------------------------------------------------

    def _wrap_layers(self, fast_replay: bool) -> None:
        # A pipeline stage holds layers start..end-1 (None before them) and caches for those only,
        # so a layer's cache (and its replayer) sits at its index less the stage's start.
        layers, start = self.inner.layers, self.stage_start
        kinds = self.base_cache()
        owned = [(i, layer) for i, layer in enumerate(layers) if layer is not None]
        if owned and isinstance(owned[0][1], HiddenTap):
            return self._share_wrapping(kinds, fast_replay)
        for i, layer in owned:
            if type(kinds[i - start]).__name__ == "ArraysCache":
                layer, self._replayers[i - start] = install_replay(layer, fast=fast_replay)
            layers[i] = HiddenTap(layer, i, self._sink)

    def _share_wrapping(self, kinds: list, fast_replay: bool) -> None:
        # Another Target wrapped this model: wrapping its taps again would hide the mixers
        # (generic replay only), so share its taps and replayers instead.
        layers, start = self.inner.layers, self.stage_start
        self._sink = next(layer for layer in layers if layer is not None).sink
        recurrent = [j for j, c in enumerate(kinds) if type(c).__name__ == "ArraysCache"]
        if recurrent and self._sink.fast_replay != fast_replay:
            raise ConfigError(f"this model already has a Target with fast_recurrent_replay={self._sink.fast_replay}; "
                              f"a second one cannot use {fast_replay}")
        for j in recurrent:
            _, self._replayers[j] = install_replay(layers[start + j].inner, fast=fast_replay)

    @property
    def pipelined(self) -> bool:
        """Whether this process holds one stage of a pipeline (mlx-lm's `pipeline(group)`): a
        slice of the decoder layers, the rest on the other ranks of the default group."""
        return self._pipelined

    @property
    def stage_start(self) -> int:
        """The first decoder layer this process holds (0 unless pipelined)."""
        return self.inner.start_idx if self._pipelined else 0

    def base_cache(self) -> list:
        """mlx-lm's own fresh caches for this model (no rollback adapters)."""
        if hasattr(self.model, "make_cache"):
            return self.model.make_cache()
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.inner.layers]

    def _probe(self) -> TargetInfo:
        tokens = mx.array([[t % self.vocab_size for t in _PROBE_IDS]])
        reference = self.model(tokens, cache=self.base_cache())
        if self.pipelined:  # one pass at a time: every rank runs the passes' collectives in one order
            mx.eval(reference)
        self._sink.want_input = True
        try:
            hidden = self.inner(tokens, cache=self.base_cache())
        finally:
            self._sink.want_input = False
        ours = self._transform(self._head(hidden))
        layer0_input, self._sink.layer0_input = self._sink.layer0_input, None
        if self.pipelined:  # layer 0 is on the last rank: every rank gets its input
            mx.eval(ours)
            layer0_input = mx.distributed.all_sum(layer0_input if layer0_input is not None else
                                                  mx.zeros(hidden.shape, hidden.dtype))
        mx.eval(reference, ours, layer0_input)
        tol = 1e-2 * (1.0 + mx.abs(reference).max().item())
        head_ok = bool(mx.abs(reference.astype(mx.float32) - ours.astype(mx.float32)).max().item() <= tol)
        if not head_ok:
            log.warning("target head differs from model(x) for %s; using the full forward", self.model_type)
        return TargetInfo(
            model_type=self.model_type,
            n_layers=self._n_layers(),
            hidden_size=int(hidden.shape[-1]),
            vocab_size=int(reference.shape[-1]),
            embed_scale=self._measure_embed_scale(tokens, layer0_input),
            head_matches_model=head_ok,
            recurrent_layers=tuple(sorted(self._replayers)),
        )

    def _n_layers(self) -> int:
        if not self.pipelined:
            return len(self.inner.layers)
        n = getattr(self.args, "num_hidden_layers", None)
        if n is None:
            raise ConfigError(f"cannot tell how many layers the pipelined {self.model_type} model has")
        return int(n)

    def _measure_embed_scale(self, tokens: mx.array, layer0_input: mx.array) -> float | None:
        """The scale s with layer0_input == embed_tokens(x) * s, up to the model's own rounding."""
        raw = self.inner.embed_tokens(tokens).astype(mx.float32)
        seen = layer0_input.astype(mx.float32)
        # The model rounds raw * s to its dtype (2^-9 relative in bf16): allow one eps of it.
        rtol = max(1e-3, float(mx.finfo(layer0_input.dtype).eps))
        bound = 1e-5 + rtol * mx.abs(seen)

        def error(scale: float) -> float:
            return (mx.abs(raw * scale - seen) / bound).max().item()

        hidden = raw.shape[-1]
        named = (1.0, hidden**0.5, float(mx.array(hidden**0.5, mx.bfloat16).item()))
        best = min(named, key=error)  # the closest, since in bf16 sqrt(H) and bf16(sqrt(H)) may both fit
        if error(best) <= 1.0:
            return best
        fitted = (mx.sum(raw * seen) / mx.maximum(mx.sum(raw * raw), 1e-30)).item()
        return fitted if error(fitted) <= 1.0 else None

    # -- facts ----------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return str(getattr(self.args, "model_type", type(self.model).__module__.split(".")[-1]))

    @property
    def vocab_size(self) -> int:
        return int(self.inner.embed_tokens.weight.shape[0]) if hasattr(self.inner.embed_tokens, "weight") \
            else int(getattr(self.args, "vocab_size"))

    @property
    def n_layers(self) -> int:
        return self.info.n_layers

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def dense_head_weight(self) -> mx.array | None:
        """[V, H] weight of an unquantized head (tied or not), or None when it is quantized."""
        head = self._head
        if isinstance(head, nn.Module):
            return None if isinstance(head, nn.QuantizedLinear) else head.weight
        emb = self.inner.embed_tokens
        return None if isinstance(emb, nn.QuantizedEmbedding) else emb.weight

    @property
    def quantized_head(self) -> nn.Module | None:
        """The quantized head (a QuantizedLinear, or the tied QuantizedEmbedding), or None when dense."""
        head = self._head if isinstance(self._head, nn.Module) else self.inner.embed_tokens
        return head if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)) else None

    @property
    def activation_dtype(self):
        """The float dtype the decoder computes in (its embedding's, or the quantization scales')."""
        emb = self.inner.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    @property
    def eos_token_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "eos_token_ids", None) or [])

    # -- compute --------------------------------------------------------------------

    def make_cache(self, reserve: int = 16, kv_bits: int | None = None, kv_group_size: int | None = None) -> list:
        """Fresh caches that can roll back up to `reserve` tokens per verify pass.

        `kv_bits` (4 or 8) stores full-attention keys/values quantized (mlx-lm's QuantizedKVCache)
        in groups of `kv_group_size` along the head dimension (default 64, or 32 where 64 does
        not divide it). Recurrent states stay as they are (they are not K/V); a sliding-window
        layer is refused, as mlx-lm cannot quantize its rotating cache.
        """
        base = self.base_cache()
        if kv_bits is not None:
            from mlx_lm.models.cache import KVCache, QuantizedKVCache

            group = self.kv_group_size(kv_bits, kv_group_size)
            for i, c in enumerate(base):
                if type(c).__name__ == "RotatingKVCache":
                    raise ConfigError(f"--kv-bits: layer {i} of {self.model_type} is a sliding-window layer "
                                      "(RotatingKVCache), which mlx-lm cannot quantize")
            base = [QuantizedKVCache(group, kv_bits) if type(c) is KVCache else c for c in base]
        elif kv_group_size is not None:
            raise ConfigError(f"--kv-group-size {kv_group_size} needs --kv-bits")
        return adapt_cache(base, reserve)

    def kv_group_size(self, kv_bits: int, group_size: int | None = None) -> int:
        """The quantization group for `kv_bits`, checked against the head dimension (MLX
        quantizes in groups of 32, 64 or 128 along it)."""
        if kv_bits not in (4, 8):
            raise ConfigError(f"kv_bits must be 4 or 8, got {kv_bits}")
        args = self.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        if group_size is None:
            if head_dim % 32:
                raise ConfigError(f"kv_bits needs a head dimension that is a multiple of 32, got {head_dim}")
            return 64 if head_dim % 64 == 0 else 32
        if group_size not in (32, 64, 128) or head_dim % group_size:
            raise ConfigError(f"kv_group_size must be 32, 64 or 128 and divide the head dimension {head_dim}, "
                              f"got {group_size}")
        return group_size

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings as the decoder's layer 0 sees them (scale included)."""
        if self.info.embed_scale is None:
            raise DFlashError(
                f"cannot reproduce the layer-0 input of {self.model_type} from embed_tokens; "
                "a drafter cannot share this target's embedding"
            )
        h = self.inner.embed_tokens(tokens)
        return h if self.info.embed_scale == 1.0 else h * self.info.embed_scale

    def head(self, hidden: mx.array) -> mx.array:
        """The raw LM head (no target logit transforms); drafters apply their own."""
        return self._head(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Target logits from final-normed hidden states (head + the family's transforms)."""
        return self._transform(self._head(hidden))

    def forward(self, tokens: mx.array, cache: list, taps: tuple[int, ...] = (),
                logits: str = "all") -> tuple[mx.array | None, mx.array | None]:
        """Run the target on `tokens [1, L]`, extending `cache`.

        Args:
            taps: decoder layer ids whose outputs to return, concatenated on the last axis.
            logits: "all" positions, "last" position only, or "none" (prefill chunks).

        Returns:
            (logits [1, L or 1, V] or None, hidden [1, L, len(taps)·H] or None)
        """
        if self.pipelined and not set(taps) <= set(self.pipeline_taps):
            raise ConfigError(f"a pipelined target gathers the taps agreed at start {list(self.pipeline_taps)}, "
                              f"not {list(taps)}")
        self._sink.wanted = frozenset(self.pipeline_taps if self.pipelined else taps)
        cache = attention_view(cache, tokens.shape[1])
        try:
            if self.info.head_matches_model:
                h = final = self.inner(tokens, cache=cache)
                out = None
                if logits == "all":
                    out = self.logits(h)
                elif logits == "last":
                    out = self.logits(h[:, -1:])
            else:
                out = final = self.model(tokens, cache=cache)
                out = out[:, -1:] if logits == "last" else (None if logits == "none" else out)
            if self.pipelined:
                hidden = self._gathered_taps(tokens.shape, taps, final)
            else:
                hidden = mx.concatenate([self._sink.outputs[i] for i in taps], axis=-1) if taps else None
        finally:
            self._sink.wanted = frozenset()
            self._sink.outputs = {}
        return out, hidden

    def _gathered_taps(self, shape: tuple, taps: tuple[int, ...], final: mx.array) -> mx.array | None:
        """The agreed taps of this pass from every stage (each rank adds the ones it holds, zeros
        for the rest), then those asked for, in their order. The sum comes after the pass's own
        collectives and is evaluated here, on every rank alike: ranks must run the same
        collectives in the same order, and a follower never reads the taps."""
        if not self.pipeline_taps:
            return None
        B, L = shape[0], shape[1]
        zeros = mx.zeros((B, L, self.hidden_size), self.activation_dtype)
        parts = mx.depends(mx.stack([self._sink.outputs.get(i, zeros) for i in self.pipeline_taps]), final)
        gathered = mx.distributed.all_sum(parts)
        mx.eval(gathered)
        return mx.concatenate([gathered[self.pipeline_taps.index(i)] for i in taps], axis=-1) if taps else None

    def arm(self, cache: list) -> None:
        """Checkpoint recurrent state before a verify pass that may be partly rejected."""
        for c in cache:
            if kind_of(c).replays:
                c.arm()

    def commit(self, cache: list, n_fed: int, n_keep: int) -> None:
        """Keep the first `n_keep` of the `n_fed` tokens of the last forward pass."""
        if not 0 < n_keep <= n_fed:
            raise ValueError(f"n_keep must be in [1, {n_fed}], got {n_keep}")
        drop = n_fed - n_keep
        recurrent = [(i, c) for i, c in enumerate(cache) if kind_of(c).replays]
        if drop:
            for i, c in recurrent:
                if c.tape is None:
                    raise RuntimeError(f"layer {i}: recurrent cache was not armed before the verify pass")
            replay_layers([(self._replayers[i], c) for i, c in recurrent], n_keep, self.stacked_replay)
            replayed = {i for i, _ in recurrent}
            for i, c in enumerate(cache):
                if i in replayed:
                    continue
                trimmed = c.trim(drop)
                if trimmed != drop:
                    raise RuntimeError(f"layer {i}: trimmed {trimmed} of {drop} tokens")
        for _, c in recurrent:
            c.disarm()

    def commit_rows(self, cache: list, n_fed: int, n_keep: list[int]) -> None:
        """`commit` for batched caches (`batch_cache.py`): row b keeps `n_keep[b]` tokens."""
        if not all(0 < n <= n_fed for n in n_keep):
            raise ValueError(f"every n_keep must be in [1, {n_fed}], got {n_keep}")
        recurrent = [(i, c) for i, c in enumerate(cache) if kind_of(c).replays]
        if min(n_keep) < n_fed:
            replay_layers([(self._replayers[i], c) for i, c in recurrent], max(n_keep), self.stacked_replay, n_keep)
        replayed = {i for i, _ in recurrent}
        for i, c in enumerate(cache):
            if i in replayed:
                c.disarm()
            else:
                c.commit(n_fed, n_keep)


def _cast(model: nn.Module, dtype) -> None:
    # Families keep some parameters in fp32 (qwen3_5's A_log); mlx-lm's convert honours this too.
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, v: mx.array) -> mx.array:
        return v.astype(dtype) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))


def load_target(path_or_repo: str, dtype: str | None = None, fast_recurrent_replay: bool = True,
                stacked_replay: bool = True, lockstep=None) -> Target:
    """Load a target: an alias (`dflash2 models`), an mlx-lm model directory, a .gguf file or a
    Hugging Face repo id, resolved as the CLI's MODEL is (`hub.target_dir`). An alias brings
    its registry defaults (e.g. the demo's float32), as `dflash2 run` applies them.

    Args:
        dtype: cast floating weights ("float32", "bfloat16", "float16") except those the
            family keeps (its `cast_predicate`, as mlx-lm's convert does); None keeps them.
        lockstep: a `distributed.Lockstep`: shard the decoder layers over its group (tensor
            parallel, or pipeline stages: its `mode`) before wrapping.
    """
    from mlx_lm import load

    from .hub import alias_defaults, target_dir

    dtype = dtype or alias_defaults(str(path_or_repo)).get("dtype")
    model, tokenizer = load(str(target_dir(str(path_or_repo))))
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        _cast(model, getattr(mx, dtype))
    if lockstep is not None:
        from .core.distributed import split_model

        split_model(model, lockstep)
    return Target(model, tokenizer, path=str(path_or_repo), fast_recurrent_replay=fast_recurrent_replay,
                  stacked_replay=stacked_replay)
