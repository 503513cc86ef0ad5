"""torch's recurrent layers (`nn.RNN`, `nn.LSTM`, `nn.GRU`) as one `lax.scan` per layer and
direction, so the traced program's size does not grow with the sequence length.

The modules call `torch.lstm` / `torch.gru` / `torch.rnn_tanh` / `torch.rnn_relu` (`torch._VF`),
whose ATen ops are composite: torch decomposes them into one cell per time step before torchax
sees any op, and torchax then traces every step (a 2-layer bidirectional GRU over 100 steps:
35,000 equations, 4 minutes of XLA compilation). `install` intercepts those four functions
above the decomposition and calls `aten._cudnn_rnn` instead, the fused op torch itself uses for
these layers on CUDA, whose arguments describe the whole layer stack (mode, sizes, projection,
dropout, direction). Being a plain ATen op, it passes through functionalization to torchax's
dispatch, where it is lowered here: the input projection of all time steps as one matrix
product, the recurrence as a `lax.scan` over time.

Packed sequences (`pack_padded_sequence` -> layer -> `pad_packed_sequence`) never build the
packed data, whose length is the sum of traced lengths: `_packed` stands the padded batch and
its lengths in for it, and the layer runs the same scans masked by the lengths (each sequence's
state stops at its length; the reverse direction starts at its last element). The lengths reach
the lowering in `aten._cudnn_rnn`'s `dropout_state` argument, a tensor cuDNN's op takes and this
lowering has no other use for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from bridge_mr._compat import torchax as torchax_compat

from . import _packed

__all__ = ["install"]

_aten = torch.ops.aten

# torch's fused RNN modes, as `aten._cudnn_rnn` numbers them (cuDNN's cudnnRNNMode_t).
_RNN_RELU, _RNN_TANH, _LSTM, _GRU = 0, 1, 2, 3
_GATES = {_RNN_RELU: 1, _RNN_TANH: 1, _LSTM: 4, _GRU: 3}
_FUNCTIONS: tuple[tuple[Any, int, str], ...] = (
    (torch.lstm, _LSTM, "nn.LSTM"),
    (torch.gru, _GRU, "nn.GRU"),
    (torch.rnn_tanh, _RNN_TANH, "nn.RNN"),
    (torch.rnn_relu, _RNN_RELU, "nn.RNN(nonlinearity='relu')"),
)


def install(env: Any, error: type[Exception], where: Callable[[], str]) -> None:
    """Makes `env` lower torch's recurrent layers to scans (see the module docstring).

    Args:
      env: the torchax `Environment`; its `dispatch` is wrapped, and `aten._cudnn_rnn` and
        `aten._pack_padded_sequence` are overridden.
      error: the exception class raised for what is not supported.
      where: returns the user's source line, for messages.
    """
    refuse = _packed.Refuse(error, where)
    env.dispatch = functools.partial(_dispatch, env.dispatch, refuse)
    env.override_op_definition(_aten._cudnn_rnn.default, functools.partial(_fused_rnn, env))
    env.override_op_definition(
        _aten._pack_padded_sequence.default,
        lambda *_: refuse("torch.ops.aten._pack_padded_sequence"),
    )


def _dispatch(
    dispatch: Any, refuse: _packed.Refuse, func: Any, types: Any, args: Any, kwargs: Any = None
) -> Any:
    """`dispatch`, with torch's four recurrent functions called as one `aten._cudnn_rnn`, and
    packing, unpacking and the layers of packed sequences done on `_packed`'s stand-ins."""
    if _packed.is_pack(func):
        return _packed.pack(refuse, args, kwargs)
    found = next((f for f in _FUNCTIONS if f[0] is func), None)
    if _packed.stand_in((args, kwargs)) is not None:
        if _packed.is_unpack(func):
            return _packed.unpack(refuse, args, kwargs)
        if found is not None and not kwargs and isinstance(args[0], _packed.PackedData):
            return _packed_layer(refuse, found, args)
        refuse(f"{getattr(func, '__name__', func)} of packed.data or packed.batch_sizes")
    if _packed.is_pad_sequence(func):
        return _packed.pad_sequence(args, kwargs)
    if _packed.constant(func, args):
        with jax.ensure_compile_time_eval():
            return dispatch(func, types, args, kwargs)
    if found is None or kwargs:
        # torch's modules call these positionally; a keyword call keeps torch's own lowering.
        return dispatch(func, types, args, kwargs)
    _, mode, layer = found
    # Packed: (data, batch_sizes, hx, params, ...); else LSTM's (input, (h0, c0), params, ...)
    # and the others' (input, h0, params, ...).
    if isinstance(args[1 if mode == _LSTM else 2], torch.Tensor):
        refuse(
            f"{layer} on a PackedSequence made by hand (expected one from pack_padded_sequence)",
            _packed.BY_HAND,
        )
    input, hx, *options, batch_first = args
    return _layer(mode, input, hx, *options, batch_first=batch_first)


def _packed_layer(refuse: _packed.Refuse, found: tuple[Any, int, str], args: Any) -> Any:
    """`torch.lstm` / `gru` / `rnn_*` (data, batch_sizes, hx, params, ...) of the stand-ins."""
    _, mode, layer = found
    data, sizes, hx, *options = args
    if not isinstance(sizes, _packed.BatchSizes):
        refuse(
            f"{layer} on a PackedSequence made by hand (expected one from pack_padded_sequence)",
            _packed.BY_HAND,
        )
    output, *states = _layer(
        mode, data.padded, hx, *options, batch_first=False, lengths=sizes.lengths
    )
    return (_packed.PackedData(output, refuse), *states)


def _layer(
    mode: int,
    input: torch.Tensor,
    hx: Any,
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    *,
    batch_first: bool,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """One recurrent layer stack as `aten._cudnn_rnn`: (output, h_n[, c_n for an LSTM])."""
    h0, c0 = hx if mode == _LSTM else (hx, None)
    directions = 2 if bidirectional else 1
    per_direction = len(params) // (num_layers * directions)
    projected = per_direction - (4 if has_biases else 2) == 1
    w_hh = params[1]
    output, h_n, c_n, _, _ = _aten._cudnn_rnn.default(
        input,
        list(params),
        per_direction,
        None,
        h0,
        c0,
        mode,
        w_hh.shape[0] // _GATES[mode],
        params[per_direction - 1].shape[0] if projected else 0,
        num_layers,
        batch_first,
        float(dropout),
        bool(train),
        bool(bidirectional),
        [],
        lengths,  # dropout_state: the lengths of a packed sequence (see the module docstring)
    )
    return (output, h_n, c_n) if mode == _LSTM else (output, h_n)


def _fused_rnn(
    env: Any,
    input: Any,
    weight: Sequence[Any],
    weight_stride0: int,
    weight_buf: Any,
    hx: Any,
    cx: Any,
    mode: int,
    hidden_size: int,
    proj_size: int,
    num_layers: int,
    batch_first: bool,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_sizes: Sequence[int],
    dropout_state: Any,
) -> tuple[Any, Any, Any, Any, Any]:
    """`aten._cudnn_rnn` (unpacked input): one scan over time per layer and direction.

    `weight` holds `weight_stride0` tensors per layer and direction, in torch's order: w_ih,
    w_hh, then b_ih, b_hh (with biases), then w_hr (with `proj_size`). `weight_buf` and
    `batch_sizes` (empty: packed input comes padded) are cuDNN's; `dropout_state` holds the
    lengths [batch] of a packed sequence (`_packed_layer`), or is None.

    Returns:
      (output, h_n, c_n, reserve, weight_buf), as torch's op; the last two are empty, and so
      is c_n but for an LSTM.
    """
    del weight_buf, batch_sizes, hidden_size
    tx = torchax_compat.import_torchax()
    value = torchax_compat.value_of
    x = value(input)
    if batch_first:
        x = jnp.swapaxes(x, 0, 1)
    h0 = value(hx)
    c0 = value(cx) if cx is not None else None
    weights = [value(w) for w in weight]
    # Packed: time step t of sequence b is valid while t < its length.
    valid = None
    if dropout_state is not None:
        valid = jnp.arange(x.shape[0])[:, None] < value(dropout_state)[None, :]
    has_bias = weight_stride0 - (1 if proj_size else 0) == 4
    directions = 2 if bidirectional else 1
    drop = train and dropout > 0 and num_layers > 1
    key = env.get_and_rotate_prng_key() if drop else None
    h_n, c_n = [], []
    for layer in range(num_layers):
        if key is not None and layer:
            x = _dropout(jax.random.fold_in(key, layer), x, dropout)
        outputs = []
        for direction in range(directions):
            i = layer * directions + direction
            w = weights[i * weight_stride0 : (i + 1) * weight_stride0]
            w_ih, w_hh = w[0], w[1]
            b_ih, b_hh = (w[2], w[3]) if has_bias else (None, None)
            w_hr = w[-1] if proj_size else None
            carry = (h0[i], c0[i]) if c0 is not None else h0[i]
            (h, c), y = _scan(mode, x, carry, w_ih, w_hh, b_ih, b_hh, w_hr, direction == 1, valid)
            outputs.append(y)
            h_n.append(h)
            c_n.append(c)
        x = outputs[0] if directions == 1 else jnp.concatenate(outputs, axis=-1)
    if batch_first:
        x = jnp.swapaxes(x, 0, 1)
    empty = jnp.zeros((0,), x.dtype)
    cell = jnp.stack(c_n) if mode == _LSTM else empty
    results = (x, jnp.stack(h_n), cell, empty, empty)
    return tuple(tx.Tensor(r, env) for r in results)  # pyright: ignore[reportReturnType]


def _dropout(key: jax.Array, x: jax.Array, p: float) -> jax.Array:
    """`torch.dropout(x, p, train=True)`, drawn from `key` (p = 1 gives zeros, as torch)."""
    if p >= 1:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(key, 1 - p, x.shape)
    return jnp.where(keep, x / (1 - p), jnp.zeros_like(x))


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = x @ w.T
    return y if b is None else y + b


def _scan(
    mode: int,
    x: jax.Array,
    carry: Any,
    w_ih: jax.Array,
    w_hh: jax.Array,
    b_ih: jax.Array | None,
    b_hh: jax.Array | None,
    w_hr: jax.Array | None,
    reverse: bool,
    valid: jax.Array | None = None,
) -> tuple[tuple[jax.Array, jax.Array | None], jax.Array]:
    """One layer in one direction over `x` [time, batch, features], as torch's cells compute.

    With `valid` [time, batch] (a packed sequence's steps), a step past a sequence's length
    leaves its state as it is and outputs zeros: the forward direction's state stops at the
    length, the reverse one stays the initial state until the sequence's last element.

    Returns:
      ((h_n, c_n or None), outputs [time, batch, hidden or proj_size]).
    """
    x_gates = _linear(x, w_ih, b_ih)  # every time step's input projection at once

    def lstm(state: tuple[jax.Array, jax.Array], x_t: jax.Array) -> Any:
        h, c = state
        i, f, g, o = jnp.split(x_t + _linear(h, w_hh, b_hh), 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        if w_hr is not None:
            h = h @ w_hr.T
        return (h, c), h

    def gru(h: jax.Array, x_t: jax.Array) -> Any:
        x_r, x_z, x_n = jnp.split(x_t, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(_linear(h, w_hh, b_hh), 3, axis=-1)
        r = jax.nn.sigmoid(x_r + h_r)
        z = jax.nn.sigmoid(x_z + h_z)
        n = jnp.tanh(x_n + r * h_n)
        h = (h - n) * z + n
        return h, h

    def simple(h: jax.Array, x_t: jax.Array) -> Any:
        pre = x_t + _linear(h, w_hh, b_hh)
        h = jnp.tanh(pre) if mode == _RNN_TANH else jax.nn.relu(pre)
        return h, h

    step: Callable[[Any, jax.Array], Any] = (
        lstm if mode == _LSTM else gru if mode == _GRU else simple
    )

    def masked(state: Any, inputs: tuple[jax.Array, jax.Array]) -> Any:
        x_t, keep = inputs
        new, y = step(state, x_t)
        kept = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, state)
        return kept, jnp.where(keep, y, jnp.zeros_like(y))

    if valid is None:
        final, y = jax.lax.scan(step, carry, x_gates, reverse=reverse)
    else:
        final, y = jax.lax.scan(masked, carry, (x_gates, valid[..., None]), reverse=reverse)
    return (final if mode == _LSTM else (final, None)), y
