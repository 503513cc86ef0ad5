"""Max- and min-pools whose windows tile their input, as a reshape and a reduction.

A max-pool's `reduce_window_max` and its gradient's `select_and_scatter_add` (and the forward
derivative's `select_and_gather_add`) compute the same values as a reshape of the input into
its windows, a max over the window axes, and the choice of one element per window. On a TPU
v5e the packed CNN round (`_packed`) took 19.1 ms this way (bench_conv_lowering) against
21.4 ms with the window primitives (an ad hoc probe timed the same way; 50 clients, "medium",
data on the chip: benchmarks/results/tpu_v5e/bench_packed_pool.txt). Under plain vmap the
reshape measured 25% slower on the chip and on the CPU 15% slower (docs/performance.md, "The
max-pool as a reshape"), so only the packed strategy uses it, and only on a TPU
(`lax.platform_dependent`).

`lowering(eqn)` gives the reshape form of an equation whose windows tile its operand (stride =
window, no padding, no dilation, every size a multiple of its window, floating point), or None.
The element a window chooses is XLA's: going through the window in row-major order, the kept
element gives way to the next unless `select(kept, next)` holds (for a max-pool `ge`: the first
maximum; a NaN never holds, so it passes the choice on); `select_and_gather_add` starts from
-inf (a max) or inf (a min), so a window of only that value chooses none. Chosen values are
set, never summed, so they are exact. Differentiating the reshaped pool gives the window
primitives' derivatives (`_pool_jvp`).
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

#: The pools' primitive names and the selection each one's windows make.
_CHOOSERS = types.MappingProxyType({"reduce_window_max": lax.ge_p, "reduce_window_min": lax.le_p})
_SELECTS = ("select_and_scatter_add", "select_and_gather_add")
#: The selections lowered (the only ones JAX's window functions make), each with its window's
#: start: the identity of the max (`ge`) or min (`le`). Another selection keeps the primitive.
_STARTS = types.MappingProxyType({lax.ge_p: -float("inf"), lax.le_p: float("inf")})


def lowering(eqn: core.JaxprEqn) -> Callable[..., Any] | None:
    """The reshape form of `eqn` (a function of its operands) where its windows tile its
    operand, else None."""
    name, params = eqn.primitive.name, eqn.params
    if name not in _CHOOSERS and name not in _SELECTS:
        return None
    operand: Any = eqn.invars[0 if name in _CHOOSERS else 1].aval  # a ShapedArray
    windows = tuple(params["window_dimensions"])
    ones = (1,) * len(windows)
    if (
        tuple(params["window_strides"]) != windows
        or any(tuple(p) != (0, 0) for p in params["padding"])
        or tuple(params.get("base_dilation", ones)) != ones
        or tuple(params.get("window_dilation", ones)) != ones
        or any(n % k for n, k in zip(operand.shape, windows, strict=True))
        or not jnp.issubdtype(operand.dtype, jnp.floating)
    ):
        return None
    if name in _CHOOSERS:
        return functools.partial(_pool, select=_CHOOSERS[name], windows=windows)
    if params["select_prim"] not in _STARTS:
        return None
    if name == "select_and_scatter_add":
        return functools.partial(_scatter, select=params["select_prim"], windows=windows)
    return functools.partial(_gather, select=params["select_prim"], windows=windows)


def _split(x: Any, windows: tuple[int, ...]) -> Any:
    """`x` [n0, n1, ..] as [n0/k0, k0, n1/k1, k1, ..]: each window's elements on odd axes."""
    return x.reshape([s for n, k in zip(x.shape, windows, strict=True) for s in (n // k, k)])


def _at(split: Any, position: tuple[int, ...]) -> Any:
    """Each window's element at `position` (within the window) of a `_split` array."""
    return split[tuple(i for p in position for i in (slice(None), p))]


def _positions(windows: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The positions within a window, in row-major order."""
    return list(itertools.product(*(range(k) for k in windows)))


def _chosen(
    operand: Any, select: core.Primitive, windows: tuple[int, ...], start: float | None = None
) -> Any:
    """The row-major index, within its window, of the element each window chooses: going
    through the window, the kept element gives way to the next unless `select(kept, next)`
    holds. Kept first: the window's first element (`select_and_scatter_add`), or a `start`
    value at index -1 (`select_and_gather_add`'s -inf for a max, inf for a min: a window of
    only -inf then chooses none)."""
    split = lax.stop_gradient(_split(operand, windows))
    positions = _positions(windows)
    if start is None:
        kept, first, rest = _at(split, positions[0]), 0, list(enumerate(positions))[1:]
    else:
        shape = tuple(n // k for n, k in zip(operand.shape, windows, strict=True))
        kept, first, rest = jnp.full(shape, start, operand.dtype), -1, list(enumerate(positions))
    chosen = jnp.full(kept.shape, first, jnp.int32)
    for i, position in rest:
        value = _at(split, position)
        moves = ~select.bind(kept, value)
        kept, chosen = jnp.where(moves, value, kept), jnp.where(moves, i, chosen)
    return chosen


def _gather(tangent: Any, operand: Any, select: core.Primitive, windows: tuple[int, ...]) -> Any:
    """`select_and_gather_add`: each window's `tangent` at the element `operand` chooses (zero
    where it chooses none)."""
    chosen, split = _chosen(operand, select, windows, _STARTS[select]), _split(tangent, windows)
    out = jnp.zeros(chosen.shape, tangent.dtype)
    for i, position in enumerate(_positions(windows)):
        out = jnp.where(chosen == i, _at(split, position), out)
    return out


def _scatter(source: Any, operand: Any, select: core.Primitive, windows: tuple[int, ...]) -> Any:
    """`select_and_scatter_add`: each window's `source` value at the element `operand`
    chooses, zeros elsewhere (in `operand`'s shape)."""
    chosen = _chosen(operand, select, windows)
    zero = jnp.zeros((), source.dtype)
    parts = [jnp.where(chosen == i, source, zero) for i in range(len(_positions(windows)))]
    stacked = jnp.stack(parts, axis=-1).reshape(*source.shape, *windows)
    rank = source.ndim  # [n0/k0, .., k0, ..] -> [n0/k0, k0, n1/k1, k1, ..]
    order = [a for d in range(rank) for a in (d, rank + d)]
    return jnp.transpose(stacked, order).reshape(operand.shape)


def _window_pool(x: Any, select: core.Primitive, windows: tuple[int, ...]) -> Any:
    """The pool as XLA's window operation (`reduce_window_max` / `_min`)."""
    start = _STARTS[select]
    return lax.reduce_window(x, start, lax.max if start < 0 else lax.min, windows, windows, "VALID")


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _pool(operand: Any, select: core.Primitive, windows: tuple[int, ...]) -> Any:
    """`reduce_window_max` / `_min`: each window's max (or min)."""
    split = _split(operand, windows)
    axes = tuple(range(1, split.ndim, 2))
    return split.max(axis=axes) if _STARTS[select] < 0 else split.min(axis=axes)


@_pool.defjvp
def _pool_jvp(select: core.Primitive, windows: tuple[int, ...], primals: Any, tangents: Any) -> Any:
    """The window operation's own derivative, so that differentiating a packed program gives
    what differentiating vmap's gives: forward `select_and_gather_add`, and in reverse its
    transpose, `select_and_scatter_add` (a reduction's derivative would share a tie among the
    maxima; and the two window primitives differ on a window of only -inf, which no one rule
    written here could match in both modes). Those window operations come back in such
    derivatives only, not in the program being packed."""
    (operand,), (tangent,) = primals, tangents
    derivative = jax.jvp(lambda x: _window_pool(x, select, windows), (operand,), (tangent,))[1]
    return _pool(operand, select, windows), derivative
