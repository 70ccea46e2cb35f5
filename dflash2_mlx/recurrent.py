"""Exact rollback of recurrent layers (GatedDeltaNet, Mamba, ...) after a verify pass.

A verify pass feeds a block of `L` tokens; only a prefix of `n` is kept. Attention caches
are trimmed; a recurrent state cannot be. The wrappers here sit around the module that
owns a `RecurrentCache`, record what that module was given during the armed pass, and
rebuild the state after `n` tokens from the checkpoint taken before the pass.

* `MixerReplay` (generic, the slow twin): re-runs the wrapped module on the first `n`
  inputs from the checkpoint. Works for any module called as `f(x, mask, cache)`.
* `GatedDeltaReplay` (fast path for mlx-lm's `qwen3_5.GatedDeltaNet`): records the
  convolution input, then replays only the depthwise conv and the gated-delta recurrence
  over `n` steps; no projection weights are read except the two tiny gate projections.

The forward pass itself is always mlx-lm's own code; only the replay is ours.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .caches import RecurrentCache


class _Sink:
    """A mutable slot shared by a wrapper and its child tap (not an MLX parameter)."""

    def __init__(self):
        self.tape: dict | None = None


def _armed(cache) -> bool:
    return isinstance(cache, RecurrentCache) and cache.tape is not None


def _slice_mask(mask, n: int, L: int):
    if mask is None or isinstance(mask, str):
        return mask
    if mask.ndim == 2 and mask.shape[-1] == L:
        return mask[:, :n]
    raise RuntimeError(f"cannot replay a recurrent layer with a mask of shape {mask.shape}")


def _split_call(args: tuple, kwargs: dict):
    """Return (x, mask, cache) of a mixer call `f(x, mask, cache)` in any arg style."""
    x = args[0]
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    cache = args[2] if len(args) > 2 else kwargs.get("cache")
    return x, mask, cache


class _Wrapper(nn.Module):
    """Forwards attribute reads to the wrapped module (decoder loops read e.g. `is_linear`)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.get("inner")
            if inner is None:
                raise
            return getattr(inner, name)


class MixerReplay(_Wrapper):
    """Generic replay: records the block input, re-runs the module on a prefix."""

    def __call__(self, *args, **kwargs):
        x, mask, cache = _split_call(args, kwargs)
        if _armed(cache):
            cache.tape["replay"] = (x, mask)
        return self.inner(*args, **kwargs)

    def replay(self, cache: RecurrentCache, n: int) -> None:
        x, mask = cache.tape["replay"]
        cache.restore()
        out = self.inner(x[:, :n], _slice_mask(mask, n, x.shape[1]), cache)
        del out


class _ConvTap(_Wrapper):
    def __init__(self, inner: nn.Module, sink: _Sink):
        super().__init__(inner)
        self.sink = sink

    def __call__(self, conv_input):
        if self.sink.tape is not None:
            self.sink.tape["conv_input"] = conv_input
        return self.inner(conv_input)


class GatedDeltaReplay(_Wrapper):
    """Fast replay for `mlx_lm.models.qwen3_5.GatedDeltaNet`: conv + recurrence only."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        self.sink = _Sink()
        inner.conv1d = _ConvTap(inner.conv1d, self.sink)

    def __call__(self, inputs, mask=None, cache=None):
        if not _armed(cache):
            return self.inner(inputs, mask, cache)
        cache.tape["inputs"] = inputs
        cache.tape["mask"] = mask
        self.sink.tape = cache.tape
        try:
            return self.inner(inputs, mask, cache)
        finally:
            self.sink.tape = None

    def replay(self, cache: RecurrentCache, n: int) -> None:
        from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

        gdn = self.inner
        tape = cache.tape
        inputs, mask = tape["inputs"], tape["mask"]
        B, L, _ = inputs.shape
        k_conv = gdn.conv_kernel_size
        conv_input = tape["conv_input"][:, : k_conv - 1 + n]
        conv_out = nn.silu(gdn.conv1d.inner(conv_input))
        q, k, v = [
            t.reshape(B, n, heads, dim)
            for t, heads, dim in zip(
                mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
                [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
                [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
        prefix = inputs[:, :n]
        _, state = gated_delta_update(
            q,
            k,
            v,
            gdn.in_proj_a(prefix),
            gdn.in_proj_b(prefix),
            gdn.A_log,
            gdn.dt_bias,
            cache.checkpoint[1],
            _slice_mask(mask, n, L),
            use_kernel=not gdn.training,
        )
        cache.cache = [mx.contiguous(conv_input[:, n:]), state]


def install_replay(layer: nn.Module, fast: bool = True):
    """Wrap the recurrent mixer of a decoder layer; return (new_layer, replayer).

    The decoder layer itself is returned unchanged when the mixer is a child attribute
    (`linear_attn`, `mixer`); otherwise the whole layer is wrapped.
    """
    from mlx_lm.models.qwen3_5 import GatedDeltaNet

    for name in ("linear_attn", "mixer"):
        mixer = getattr(layer, name, None) if name in layer else None
        if isinstance(mixer, nn.Module):
            if isinstance(mixer, (MixerReplay, GatedDeltaReplay)):
                return layer, mixer
            wrapper = (
                GatedDeltaReplay(mixer)
                if fast and type(mixer) is GatedDeltaNet
                else MixerReplay(mixer)
            )
            setattr(layer, name, wrapper)
            return layer, wrapper
    if isinstance(layer, MixerReplay):
        return layer, layer
    wrapper = MixerReplay(layer)
    return wrapper, wrapper
