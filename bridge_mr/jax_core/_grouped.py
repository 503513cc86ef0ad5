"""Grouped convolutions as batched matrix products: an exact, opt-in lowering, measured.

`jax.vmap` of a convolution whose input and kernel both vary per client (local training from
per-client weights: every step after the first, and the kernel gradient) becomes one grouped
convolution, a group per client (`feature_group_count`; a gradient taken outside the vmap
gives `batch_group_count`). `matmul_convolutions` rewrites each such convolution into its
patches and one `dot_general` whose batch dimension is the group: the patches are strided
slices of the (padded, dilated) input, gathered by whichever of the window offsets or the
output positions are fewer (the kernel gradient's window is the whole image), so they move data
only; the product runs at the precision the convolution would have (its `precision`, else
`jax.default_matmul_precision`). Gradients are taken of the rewritten program, so they are
matrix products too.

Nothing applies it by default, because it measured slower where it was meant to help. On a TPU
v5e (issue 42; `benchmarks/studies/bench_conv_lowering.py`), the pfl CNN FedAvg round of 50
clients took 187 ms at "medium" and 325 ms at "highest", against 53 ms and 131 ms for XLA:TPU's
own grouped convolutions (which its compiler lowers without `feature_group_count`); its patches
also need more memory (500 clients at "medium": 16.9 GB, where the grouped round fits). On CPU
it speeds up a vmap of grouped convolutions (1.4 s against 2.0 s a round of 10 clients) but not
past "per_client" (0.8 s), which `auto` picks there. It stays for JAX programs on backends
whose grouped convolutions are slow, and as the lowering the issue 42 rows compare against.

A convolution stays as it is where the rewrite would not pay: ungrouped ones (a shared kernel
or a shared input, which vmap folds into the batch or the features), per-group products too
narrow for a matrix unit (depthwise convolutions: one input and output channel per group),
patches of over `MAX_PATCH_SLICES` slices, and convolutions on explicitly sharded values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend.core.primitives import conv_general_dilated_p

from ._layouts import sharded
from ._rewrite import equations, rewritten

F = TypeVar("F", bound=Callable[..., Any])

#: A rewritten convolution's patches are this many strided slices at most (the fewer of its
#: window offsets and output positions); beyond, the patches cost more memory and compile time
#: than the rewrite saves.
MAX_PATCH_SLICES = 64
#: The narrowest per-group product rewritten: at least this many output features and this many
#: contracted values (input features x window) per group (a depthwise convolution has 1 and 9).
MIN_GROUP_WIDTH = 8


def matmul_convolutions(fn: F) -> F:
    """`fn` with its grouped convolutions as batched matrix products (see the module).

    Opt-in (the module says where it measured faster and slower): apply it to a JAX function
    that vmaps convolutions over per-client weights (local training of a CNN, say), and time
    it against the function as it is on your device. Each call traces `fn` (under whatever
    transformation the call is under), rewrites the jaxpr (sub-jaxprs too: scans of local
    steps, loops, conditionals, checkpoints) and evaluates it: the same outputs and pytrees
    as `fn`, differentiable and batchable as usual, its values those of the grouped
    convolutions up to the order of the float sums.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).

    Returns:
      A function with `fn`'s signature and results.

    Raises:
      Whatever tracing `fn` raises.

    Example:
      >>> from bridge_mr.jax_core import matmul_convolutions
      >>> def per_client(w, x):  # one client's NCHW convolution of its own kernel
      ...     return jax.lax.conv(x, w, window_strides=(1, 1), padding="SAME")
      >>> ws, xs = jnp.ones((5, 16, 8, 3, 3)), jnp.ones((5, 2, 8, 12, 12))  # 5 clients
      >>> grouped = jax.vmap(per_client)  # one convolution of 5 groups
      >>> fast = matmul_convolutions(grouped)
      >>> bool(jnp.allclose(jax.jit(fast)(ws, xs), jax.jit(grouped)(ws, xs)))
      True
      >>> "dot_general" in str(jax.make_jaxpr(fast)(ws, xs))
      True
    """
    return rewritten(fn, lambda closed: (grouped_as_matmul,))


def grouped_as_matmul(eqn: core.JaxprEqn) -> list[core.JaxprEqn] | None:
    """A grouped convolution `eqn` as patches and a batched `dot_general` (a `_rewrite` rule):
    None for another equation, or a convolution the rewrite would not speed up."""
    if eqn.primitive is not conv_general_dilated_p:
        return None
    params = eqn.params
    avals: list[Any] = [atom.aval for atom in eqn.invars]
    if params.get("out_sharding") is not None or any(map(sharded, avals)):
        return None  # The shardings in the types would need the same reshapes.
    out: Any = eqn.outvars[0].aval
    if not _pays(tuple(avals[1].shape), tuple(out.shape), params):
        return None
    return equations(lambda lhs, rhs: grouped_convolution(lhs, rhs, **params), eqn)


def grouped_convolution(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    dimension_numbers: lax.ConvDimensionNumbers,
    feature_group_count: int,
    batch_group_count: int,
    precision: Any,
    preferred_element_type: Any,
    **_: Any,
) -> jax.Array:
    """`lax.conv_general_dilated` with these params, computed as patches and a batched product."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    x = lax.transpose(lhs, tuple(lhs_spec))  # (N, C, spatial...)
    w = lax.transpose(rhs, tuple(rhs_spec))  # (O, C / feature groups, window...)
    if any(p != (0, 0) for p in padding) or any(d != 1 for d in lhs_dilation):
        config = [(0, 0, 0), (0, 0, 0)]
        config += [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation, strict=True)]
        x = lax.pad(x, lax.full((), 0, x.dtype), config)
    window = w.shape[2:]
    out_sizes = _out_sizes(x.shape[2:], window, window_strides, rhs_dilation)
    patches = _patches(x, window, out_sizes, window_strides, rhs_dilation)  # (N, C, K, P)
    n, c, k, p = patches.shape
    o = w.shape[0]
    if batch_group_count > 1:
        g = batch_group_count
        patches = patches.reshape(g, n // g, c, k, p)
        kernel = w.reshape(g, o // g, c, k)
    else:
        g = feature_group_count
        patches = patches.reshape(n, g, c // g, k, p).transpose(1, 0, 2, 3, 4)
        kernel = w.reshape(g, o // g, c // g, k)
    # (G, N', C', K, P) x (G, O', C', K) -> (G, N', P, O')
    product = lax.dot_general(
        patches,
        kernel,
        (((2, 3), (2, 3)), ((0,), (0,))),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    out = product.transpose(1, 0, 3, 2).reshape(product.shape[1], o, *out_sizes)
    return lax.transpose(out, tuple(int(i) for i in np.argsort(out_spec)))


def _pays(rhs: tuple[int, ...], out: tuple[int, ...], params: dict[str, Any]) -> bool:
    """Whether a convolution of this kernel shape, output shape and params is grouped, wide
    enough per group for a matrix unit, and gathered in at most `MAX_PATCH_SLICES` slices."""
    groups_f, groups_b = params["feature_group_count"], params["batch_group_count"]
    if groups_f == groups_b == 1:
        return False
    _, rhs_spec, _ = params["dimension_numbers"]
    out_per_group = rhs[rhs_spec[0]] // (groups_f * groups_b)
    contracted = rhs[rhs_spec[1]] * math.prod(rhs[d] for d in rhs_spec[2:])
    slices = patch_slices(rhs, out, params["dimension_numbers"])
    return min(out_per_group, contracted) >= MIN_GROUP_WIDTH and 0 < slices <= MAX_PATCH_SLICES


def patch_slices(rhs: Sequence[int], out: Sequence[int], dimension_numbers: Any) -> int:
    """How many strided slices `grouped_convolution` gathers a convolution's patches in, for
    this kernel shape and output shape: the fewer of its window offsets and output positions
    (0 for an empty output)."""
    _, rhs_spec, out_spec = dimension_numbers
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    return min(window, math.prod(out[d] for d in out_spec[2:]))


def _out_sizes(
    spatial: Sequence[int], window: Sequence[int], strides: Sequence[int], dilation: Sequence[int]
) -> list[int]:
    return [
        (s - (k - 1) * d - 1) // st + 1 if s >= (k - 1) * d + 1 else 0
        for s, k, st, d in zip(spatial, window, strides, dilation, strict=True)
    ]


def _patches(
    x: jax.Array,
    window: Sequence[int],
    outs: Sequence[int],
    strides: Sequence[int],
    dilation: Sequence[int],
) -> jax.Array:
    """`x` (N, C, spatial...) as patches (N, C, window offsets, output positions): strided
    slices, one per window offset or one per output position, whichever are fewer."""
    n, c = x.shape[:2]
    by_offset = math.prod(window) <= math.prod(outs)
    # Slice i starts at index[i] * step[i] and takes `count[i]` values `stride[i]` apart.
    index, step, count, stride = (
        (window, dilation, outs, strides) if by_offset else (outs, strides, window, dilation)
    )
    parts = []
    for at in itertools.product(*map(range, index)):
        starts = [a * st for a, st in zip(at, step, strict=True)]
        limits = [b + (m - 1) * s + 1 for b, m, s in zip(starts, count, stride, strict=True)]
        parts.append(lax.slice(x, (0, 0, *starts), (n, c, *limits), (1, 1, *stride)))
    # By offset: (N, C, K, outs...); by position: (N, C, window..., P).
    stacked = jnp.stack(parts, axis=2 if by_offset else -1)
    return stacked.reshape(n, c, math.prod(window), math.prod(outs))
