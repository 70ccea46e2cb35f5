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
* `replay_stacked` (default for a model's GatedDeltaNet layers): the same replay for all
  same-shape layers at once, from the recorded gates, as one batched conv + recurrence.
  `GatedDeltaReplay.replay` per layer is its slow twin.

The forward pass itself is always mlx-lm's own code; only the replay is ours.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .caches import RecurrentCache, Tape


class _Sink:
    """A mutable slot shared by a wrapper and its child tap (not an MLX parameter)."""

    def __init__(self):
        self.tape: Tape | None = None


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
            cache.tape.replay = (x, mask)
        return self.inner(*args, **kwargs)

    def replay(self, cache: RecurrentCache, n: int, row_n: mx.array | None = None) -> None:
        """Re-run the first `n` inputs from the checkpoint; with `row_n` [B], each row alone
        on its first `row_n[b]` (the module's own mask semantics are unknown)."""
        x, mask = cache.tape.replay
        if row_n is None:
            cache.restore()
            out = self.inner(x[:, :n], _slice_mask(mask, n, x.shape[1]), cache)
            del out
            return
        states = []
        for b, n_b in enumerate(row_n.tolist()):
            row = RecurrentCache(len(cache.cache))
            row.cache = [None if a is None else a[b : b + 1] for a in cache.checkpoint]
            row_mask = mask[b : b + 1] if mask is not None and not isinstance(mask, str) and mask.ndim == 2 else mask
            self.inner(x[b : b + 1, :n_b], _slice_mask(row_mask, n_b, x.shape[1]), row)
            states.append(row.cache)
        cache.cache = [mx.concatenate([st[j] for st in states]) for j in range(len(cache.cache))]


class _Tap(_Wrapper):
    """Records the input (or the output) of a one-argument child under `key` in the tape."""

    def __init__(self, inner: nn.Module, sink: _Sink, key: str, output: bool = False):
        super().__init__(inner)
        self.sink = sink
        self.key = key
        self.output = output

    def __call__(self, x):
        y = self.inner(x)
        if self.sink.tape is not None:
            setattr(self.sink.tape, self.key, y if self.output else x)
        return y


class GatedDeltaReplay(_Wrapper):
    """Fast replay for `mlx_lm.models.qwen3_5.GatedDeltaNet`: conv + recurrence only."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        self.sink = _Sink()
        inner.conv1d = _Tap(inner.conv1d, self.sink, "conv_input")
        # The gate projections' outputs let the stacked replay skip per-layer matmuls.
        inner.in_proj_a = _Tap(inner.in_proj_a, self.sink, "a", output=True)
        inner.in_proj_b = _Tap(inner.in_proj_b, self.sink, "b", output=True)

    def __call__(self, inputs, mask=None, cache=None):
        if not _armed(cache):
            return self.inner(inputs, mask, cache)
        cache.tape.inputs = inputs
        cache.tape.mask = mask
        self.sink.tape = cache.tape
        try:
            return self.inner(inputs, mask, cache)
        finally:
            self.sink.tape = None

    def replay(self, cache: RecurrentCache, n: int, row_n: mx.array | None = None) -> None:
        """Rebuild the state after `n` kept steps; with `row_n` [B] (each <= n), after
        `row_n[b]` steps for row b (the steps past a row's count are masked out)."""
        from mlx_lm.models.gated_delta import gated_delta_update

        if n == 0:
            cache.restore()
            return
        gdn = self.inner
        tape = cache.tape
        inputs, mask = tape.inputs, tape.mask
        L = inputs.shape[1]
        conv_input = tape.conv_input[:, : gdn.conv_kernel_size - 1 + n]
        q, k, v = _split_qkv(gdn, nn.silu(gdn.conv1d.inner(conv_input)), n)
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
            _keep_mask(_slice_mask(mask, n, L), n, row_n),
            use_kernel=not gdn.training,
        )
        cache.cache = [_conv_state(conv_input, n, gdn.conv_kernel_size - 1, row_n), state]


def _keep_mask(mask, n: int, row_n: mx.array | None):
    """The replay's step mask: the recorded one, and for per-row counts `t < row_n[b]`."""
    if row_n is None:
        return mask
    keep = mx.arange(n)[None] < row_n[:, None]
    return keep if mask is None else mask & keep


def _conv_state(conv_input: mx.array, n: int, n_state: int, row_n: mx.array | None) -> mx.array:
    """The conv's state rows after `n` steps (`row_n[b]` for row b): the last `n_state` inputs."""
    if row_n is None:
        return mx.contiguous(conv_input[:, n:])
    rows = (row_n[:, None] + mx.arange(n_state)[None])[..., None]
    return mx.take_along_axis(conv_input, rows, axis=1)


def _split_qkv(gdn: nn.Module, conv_out: mx.array, n: int):
    """q, k, v `[B, n, heads, dim]` from the conv output, normalised as GatedDeltaNet does."""
    from mlx_lm.models.gated_delta import normalize_qk

    B = conv_out.shape[0]
    q, k, v = [
        t.reshape(B, n, heads, dim)
        for t, heads, dim in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def _stack_key(replayer: nn.Module, cache: RecurrentCache):
    """Layers with equal keys replay as one stack (same shapes and dtypes); None: per layer."""
    if not isinstance(replayer, GatedDeltaReplay):
        return None
    gdn, tape = replayer.inner, cache.tape
    mask, state = tape.mask, cache.checkpoint[1]
    if mask is not None and (isinstance(mask, str) or mask.ndim != 2):
        return None
    arrays = (tape.conv_input, tape.a, tape.b, gdn.conv1d.inner.weight, gdn.A_log, gdn.dt_bias,
              mask, state)
    dims = (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.training)
    return dims + tuple(None if a is None else (a.shape, a.dtype) for a in arrays)


def _stack(arrays: list) -> mx.array:
    """`S` arrays `[B, ...]` as one `[S·B, ...]`, layer-major."""
    out = mx.stack(arrays)
    return out.reshape(-1, *out.shape[2:])


def replay_stacked(pairs: list, n: int, row_n: mx.array | None = None) -> None:
    """Replay `n` steps of same-shape GatedDeltaNet layers as one batched conv + recurrence.

    `pairs` are (GatedDeltaReplay, armed RecurrentCache) with equal `_stack_key`s. The layer
    axis folds into the conv's channels (each layer keeps its own depthwise kernels) and
    into the recurrence's batch, so the whole group is one graph instead of one per layer.
    """
    from mlx_lm.models.gated_delta import gated_delta_update

    if n == 0:
        for _, cache in pairs:
            cache.restore()
        return
    gdns, tapes = [r.inner for r, _ in pairs], [c.tape for _, c in pairs]
    first, S = gdns[0], len(pairs)
    B, _, C = tapes[0].conv_input.shape
    conv_in = [t.conv_input[:, : first.conv_kernel_size - 1 + n] for t in tapes]
    weight = mx.concatenate([g.conv1d.inner.weight for g in gdns])
    conv_out = nn.silu(mx.conv1d(mx.concatenate(conv_in, axis=-1), weight, groups=S * C))
    conv_out = conv_out.reshape(B, n, S, C).transpose(2, 0, 1, 3).reshape(S * B, n, C)
    q, k, v = _split_qkv(first, conv_out, n)

    def per_layer(params: list) -> mx.array:  # [S·B, 1, Hv]: each layer's A_log / dt_bias
        return mx.repeat(mx.stack(params), B, axis=0)[:, None]

    states = [c.checkpoint[1] for _, c in pairs]
    mask = tapes[0].mask
    _, state = gated_delta_update(
        q,
        k,
        v,
        _stack([t.a[:, :n] for t in tapes]),
        _stack([t.b[:, :n] for t in tapes]),
        per_layer([g.A_log for g in gdns]),
        per_layer([g.dt_bias for g in gdns]),
        None if states[0] is None else _stack(states),
        _keep_mask(None if mask is None else _stack([t.mask[:, :n] for t in tapes]), n,
                   None if row_n is None else mx.tile(row_n, S)),
        use_kernel=not first.training,
    )
    state = state.reshape(S, B, *state.shape[1:])
    for i, (_, cache) in enumerate(pairs):
        cache.cache = [_conv_state(conv_in[i], n, first.conv_kernel_size - 1, row_n), state[i]]


def replay_layers(pairs: list, n: int, stacked: bool = True, n_keep: list[int] | None = None) -> None:
    """Rebuild every armed recurrent layer's state after `n` kept steps of the last pass.

    With `stacked`, GatedDeltaNet layers of equal shapes replay as one stack
    (`replay_stacked`); the others, and every layer without it, replay on their own. For a
    batch whose row b keeps `n_keep[b]` steps (`n` their maximum), GatedDeltaNet layers mask
    out the later steps of shorter rows; the generic replay runs row by row (the slow twin).
    """
    row_n = None if n_keep is None or min(n_keep) == n else mx.array(n_keep, mx.int32)
    groups: dict = {}
    for replayer, cache in pairs:
        key = _stack_key(replayer, cache) if stacked else None
        if key is None:
            replayer.replay(cache, n, row_n)
        else:
            groups.setdefault(key, []).append((replayer, cache))
    for group in groups.values():
        if len(group) == 1:
            group[0][0].replay(group[0][1], n, row_n)
        else:
            replay_stacked(group, n, row_n)


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
