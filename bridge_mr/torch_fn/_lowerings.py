"""bridge_mr's own lowerings of torch ops whose torchax lowering gives wrong values or fails.

* `aten._embedding_bag` / `aten._embedding_bag_forward_only` (`F.embedding_bag`,
  `nn.EmbeddingBag`): torchax 0.0.14's lowering ignores `per_sample_weights` and
  `padding_idx` (silently: a weighted sum came out unweighted, padding entries were summed),
  fails in `max` mode, and reads `offsets` as numpy, so under `jax.jit` every call failed. Here
  each index finds its bag from the offsets as traced values (a `searchsorted`) and one segment
  sum (or max) per bag gives the result, so offsets may be arguments.
* `aten.multilabel_margin_loss_forward` (`F.multilabel_margin_loss`): torchax runs torch's
  own decomposition, which (torch 2.9 - 2.13) adds a hinge term for every target slot after
  the first -1 as if it named class 0: a larger loss whenever a target list is shorter than
  the number of classes. Here those slots are masked out, as torch's kernels do.
* `aten.linalg_vector_norm` (`torch.norm`, `F.normalize`, `torch.dist`), `aten._cdist_forward`
  (`torch.cdist`) and `aten._pdist_forward` (`F.pdist`): torchax's are `sqrt(sum(x ** 2))`
  (and `(sum |x| ** p) ** (1 / p)`), whose gradient at a zero norm is NaN (inf x 0), where
  torch's is 0: `F.normalize` of a zero row, `torch.cdist(x, x)` (its diagonal) and every
  `F.pdist` (torchax computes the full matrix, diagonal included) had NaN gradients. Here a
  zero norm has gradient 0, as in torch.
* `Tensor.fill_diagonal_` (a contrastive loss's `similarity.fill_diagonal_(-inf)`):
  functionalization refuses it (torch's "custom (non-ATen) operator whose output has alias
  annotations"). Here it is `masked_fill_` with the diagonal's mask, `wrap=` as torch's.

Gradients come from JAX differentiating these lowerings (`from_torch` never runs torch's
backward ops).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr._compat import torchax as torchax_compat

__all__ = ["install"]

_aten = torch.ops.aten

# `aten._embedding_bag`'s modes.
_SUM, _MEAN, _MAX = 0, 1, 2


def install(env: Any) -> None:
    """Overrides torchax's lowering of the ops above in `env` (a torchax `Environment`); wraps
    its dispatch for the Python-level ones."""
    env.dispatch = functools.partial(_dispatch, env, env.dispatch)
    bag = functools.partial(_embedding_bag, env)
    env.override_op_definition(_aten._embedding_bag.default, bag)
    env.override_op_definition(_aten._embedding_bag_forward_only.default, bag)
    env.override_op_definition(
        _aten.multilabel_margin_loss_forward.default,
        functools.partial(_multilabel_margin_loss_forward, env),
    )
    env.override_op_definition(
        _aten.linalg_vector_norm.default, functools.partial(_vector_norm, env)
    )
    env.override_op_definition(_aten._cdist_forward.default, functools.partial(_cdist, env))
    env.override_op_definition(_aten._pdist_forward.default, functools.partial(_pdist, env))
    env.override_op_definition(_aten.dist.default, functools.partial(_dist, env))


def _dispatch(env: Any, dispatch: Any, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
    if func is torch.Tensor.fill_diagonal_:
        return _fill_diagonal(env, *args, **(kwargs or {}))
    return dispatch(func, types, args, kwargs)


def _fill_diagonal(env: Any, self: torch.Tensor, fill_value: Any, wrap: bool = False) -> Any:
    """`self.fill_diagonal_(fill_value, wrap)` as `self.masked_fill_(diagonal, fill_value)`: the
    positions torch's kernel writes (a contiguous tensor's storage: every (sum of strides)-th
    element, min(rows, columns) of them; with `wrap`, a 2-D tensor taller than wide goes on
    below, after each `columns + 1` rows)."""
    shape = tuple(self.shape)
    if len(shape) < 2:
        raise RuntimeError("dimensions must larger than 1")  # torch's own message
    if len(shape) > 2 and len(set(shape)) > 1:
        raise RuntimeError("all dimensions of input must be of equal length")
    height, width = shape[0], shape[1]
    strides = np.cumprod((1, *shape[:0:-1]))[::-1]
    step = int(strides.sum())
    flat = np.zeros(int(np.prod(shape)), dtype=bool)
    flat[: min(height, width) * step : step] = True
    if wrap and len(shape) == 2 and height > width + 1:
        flat[width * (width + 1) :: step] = True
    tx = torchax_compat.import_torchax()
    with jax.ensure_compile_time_eval():
        mask = tx.Tensor(jnp.asarray(flat.reshape(shape)), env)
    return self.masked_fill_(mask, fill_value)


def _value(tensor: Any) -> Any:
    return None if tensor is None else torchax_compat.value_of(tensor)


def _embedding_bag(
    env: Any,
    weight: Any,
    indices: Any,
    offsets: Any,
    scale_grad_by_freq: bool = False,
    mode: int = _SUM,
    sparse: bool = False,
    per_sample_weights: Any = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[Any, Any, Any, Any]:
    """`aten._embedding_bag(weight, indices, offsets, ...)`: each bag's sum, mean or max of the
    rows its indices name (indices 1-D; bag b holds positions offsets[b] up to the next
    offset). Entries naming `padding_idx` (-1: none) count for nothing; an empty bag is zeros.

    Returns (output [bags, dim], offset2bag, bag_size, max_indices), as torch's op.
    """
    del scale_grad_by_freq, sparse  # Hints for torch's backward; JAX's gradient is dense.
    tx = torchax_compat.import_torchax()
    w, index, starts = _value(weight), _value(indices), _value(offsets)
    positions = jnp.arange(index.shape[0])
    if include_last_offset:
        starts, end = starts[:-1], starts[-1]
    else:
        end = index.shape[0]
    bags = starts.shape[0]
    bag = jnp.searchsorted(starts, positions, side="right") - 1
    valid = (positions < end) & (bag >= 0)
    if padding_idx >= 0:
        valid = valid & (index != padding_idx)
    segment = jnp.where(valid, bag, bags)  # invalid entries go to a bag that is dropped
    rows = jnp.take(w, index, axis=0)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), segment, num_segments=bags + 1)[:bags]
    if mode == _MAX:
        best = jax.ops.segment_max(rows, segment, num_segments=bags + 1)[:bags]
        out = jnp.where((count > 0)[:, None], best, jnp.zeros_like(best))
        is_best = (rows == out[jnp.clip(segment, 0, bags - 1)]) & valid[:, None]
        chosen = jnp.where(is_best, index[:, None], -1)
        max_indices = jax.ops.segment_max(chosen, segment, num_segments=bags + 1)[:bags]
    else:
        if per_sample_weights is not None:
            rows = rows * _value(per_sample_weights)[:, None].astype(rows.dtype)
        out = jax.ops.segment_sum(rows, segment, num_segments=bags + 1)[:bags]
        if mode == _MEAN:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        max_indices = count
    return tuple(tx.Tensor(v, env) for v in (out.astype(w.dtype), bag, count, max_indices))


def _multilabel_margin_loss_forward(
    env: Any, input: Any, target: Any, reduction: int
) -> tuple[Any, Any]:
    """`aten.multilabel_margin_loss_forward`: for each sample, the hinge
    max(0, 1 - (x[j] - x[k])) / classes summed over its targets j (the target slots before the
    first -1) and the classes k that are not targets; reduced by `reduction` (0 none, 1 mean,
    2 sum).

    Returns (loss, is_target), `is_target` in the input's dtype and the target's shape.
    """
    tx = torchax_compat.import_torchax()
    x, t = _value(input), _value(target)
    shape = t.shape
    x, t = jnp.atleast_2d(x), jnp.atleast_2d(t)
    classes = x.shape[1]
    slot = jnp.arange(classes)
    end = jnp.min(jnp.where(t == -1, slot, classes), axis=-1, keepdims=True)
    listed = slot < end  # [n, slot]: the slots that name a target
    named = jnp.where(listed, t, -1)
    is_target = jnp.any(slot[None, None, :] == named[:, :, None], axis=1)  # [n, class]
    u = jnp.take_along_axis(x, jnp.where(listed, t, 0), axis=-1)  # [n, slot]
    hinge = jnp.maximum(1 - u[:, :, None] + x[:, None, :], 0) / classes  # [n, slot, class]
    hinge = jnp.where(listed[:, :, None] & ~is_target[:, None, :], hinge, 0)
    loss = hinge.sum(axis=(1, 2))
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2:
        loss = loss.sum()
    elif len(shape) < 2:
        loss = loss.reshape(())
    return tx.Tensor(loss, env), tx.Tensor(is_target.astype(x.dtype).reshape(shape), env)


def _norm(x: Any, order: float, axis: Any = None, keepdims: bool = False) -> Any:
    """The `order`-norm of `x` over `axis`, its gradient 0 where the norm is 0 (as torch's)."""
    a = jnp.abs(x)
    if order == 0:
        return jnp.sum((a != 0).astype(x.dtype), axis=axis, keepdims=keepdims)
    if order == float("inf"):
        return jnp.max(a, axis=axis, keepdims=keepdims)
    if order == float("-inf"):
        return jnp.min(a, axis=axis, keepdims=keepdims)
    total = jnp.sum(x * x if order == 2 else a**order, axis=axis, keepdims=keepdims)
    zero = total == 0
    # Both branches of the where are differentiated: the root only of a nonzero sum.
    root = jnp.sqrt if order == 2 else (lambda v: v ** (1.0 / order))
    return jnp.where(zero, 0, root(jnp.where(zero, 1, total)))


def _vector_norm(
    env: Any,
    input: Any,
    ord: float = 2,
    dim: Any = None,
    keepdim: bool = False,
    *,
    dtype: Any = None,
) -> Any:
    """`aten.linalg_vector_norm(input, ord, dim, keepdim, dtype=)` (see the module docstring)."""
    tx = torchax_compat.import_torchax()
    x = _value(input)
    if dtype is not None:
        x = x.astype(jnp.dtype(str(dtype).removeprefix("torch.")))
    elif not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.float32)
    axis = None if dim is None or (isinstance(dim, (list, tuple)) and not dim) else dim
    axis = tuple(axis) if isinstance(axis, (list, tuple)) else axis
    return tx.Tensor(_norm(x, float(ord), axis, keepdim), env)


def _cdist(env: Any, x1: Any, x2: Any, p: float, compute_mode: Any = None) -> Any:
    """`aten._cdist_forward(x1 [.., P, M], x2 [.., R, M], p)`: the [.., P, R] distances."""
    del compute_mode  # torch's choice of a matrix-product formula; this one is exact
    tx = torchax_compat.import_torchax()
    a, b = _value(x1), _value(x2)
    difference = a[..., :, None, :] - b[..., None, :, :]
    return tx.Tensor(_norm(difference, float(p), axis=-1), env)


def _pdist(env: Any, input: Any, p: float = 2) -> Any:
    """`aten._pdist_forward(input [N, M], p)`: the distances of the pairs i < j, row-major."""
    tx = torchax_compat.import_torchax()
    x = _value(input)
    first, second = np.triu_indices(x.shape[0], k=1)
    return tx.Tensor(_norm(x[first] - x[second], float(p), axis=-1), env)


def _dist(env: Any, input: Any, other: Any, p: float = 2) -> Any:
    """`aten.dist(input, other, p)`: the p-norm of their (broadcast) difference."""
    tx = torchax_compat.import_torchax()
    return tx.Tensor(_norm(_value(input) - _value(other), float(p)), env)
