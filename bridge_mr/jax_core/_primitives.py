"""The three placement primitives: `placed_broadcast`, `placed_sum` and `placed_mean`.

Each takes static params `placement` (axis name), `size` (number of placed values: an int, or a
`jax.export` symbolic dimension, which shapes, lowering and transposes carry through) and `mesh`
(a mesh whose Explicit `placement` axis types the placed values, else None). Auto meshes need no
param: the API adds sharding constraints around the primitives, where `jit` sees them. All three are
linear: their JVP applies the primitive to the tangent, and the transposes pair them up
(broadcastᵀ = sum, sumᵀ = broadcast, meanᵀ = broadcast / size), so gradients of programs built
from them are again programs of these primitives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir, xla
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ._mesh import AnyMesh, abstract, axis_type
from ._program import Size


def _is_explicit(mesh: AnyMesh | None, placement: str) -> TypeGuard[AnyMesh]:
    """Whether `mesh` is a mesh whose `placement` axis is Explicit."""
    return mesh is not None and axis_type(mesh, placement) == AxisType.Explicit


def sum_dtype(dtype: np.dtype) -> np.dtype:
    """Sum keeps the dtype, except bool, which counts (default int dtype)."""
    if dtype == np.bool_:
        return jax.dtypes.canonicalize_dtype(np.int64)
    return dtype


def mean_dtype(dtype: np.dtype) -> np.dtype:
    """Mean keeps inexact dtypes; bool and integers give the default float dtype."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jax.dtypes.canonicalize_dtype(np.float64)


def _check_placed_aval(x: Any, placement: str, size: Size, name: str) -> None:
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(
            f"{name} reduces over the leading {placement!r} axis of size {size}; got a value of "
            f"shape {x.shape}."
        )


# --- placed_broadcast -------------------------------------------------------------------------

broadcast_p = jex_core.Primitive("placed_broadcast")
broadcast_p.def_impl(functools.partial(xla.apply_primitive, broadcast_p))


def placed_broadcast(x: jax.Array, *, placement: str, size: Size, mesh: AnyMesh | None) -> Any:
    """Binds `placed_broadcast`: `x` repeated `size` times along a new leading axis."""
    return broadcast_p.bind(x, placement=placement, size=size, mesh=mesh)


def _broadcast_abstract_eval(x: Any, *, placement: str, size: Size, mesh: AnyMesh | None) -> Any:
    spec = x.sharding.spec
    if _is_explicit(mesh, placement):
        sharding = NamedSharding(abstract(mesh), P(placement, *spec))
    else:
        sharding = x.sharding.update(spec=P(None, *spec))
    return x.update(shape=(size, *x.shape), sharding=sharding)


broadcast_p.def_abstract_eval(_broadcast_abstract_eval)


def _broadcast_lowering_fn(
    x: jax.Array, *, placement: str, size: Size, mesh: AnyMesh | None
) -> jax.Array:
    shape = (size, *x.shape)
    if _is_explicit(mesh, placement):
        spec = P(placement, *jax.typeof(x).sharding.spec)
        return jnp.broadcast_to(x, shape, out_sharding=NamedSharding(abstract(mesh), spec))
    return jnp.broadcast_to(x, shape)


mlir.register_lowering(broadcast_p, mlir.lower_fun(_broadcast_lowering_fn, multiple_results=False))


def _broadcast_transpose(ct: Any, x: Any, *, placement: str, size: Size, mesh: Any) -> list[Any]:
    del x  # Unused.
    return [placed_sum(ct, placement=placement, size=size, mesh=mesh)]


ad.deflinear2(broadcast_p, _broadcast_transpose)


def _broadcast_batch(
    args: tuple[jax.Array], dims: tuple[int], *, placement: str, size: Size, mesh: Any
) -> tuple[jax.Array, int]:
    (x,), (dim,) = args, dims
    return placed_broadcast(x, placement=placement, size=size, mesh=mesh), dim + 1


batching.primitive_batchers[broadcast_p] = _broadcast_batch


# --- placed_sum and placed_mean: the reductions over the leading placement axis ---------------


def _reduced_aval(x: Any, dtype: np.dtype) -> Any:
    sharding = x.sharding.update(spec=P(*x.sharding.spec[1:]))
    weak_type = x.weak_type and dtype == x.dtype
    return x.update(shape=x.shape[1:], dtype=dtype, weak_type=weak_type, sharding=sharding)


def _reduction_batch(
    primitive: jex_core.Primitive,
    args: tuple[jax.Array],
    dims: tuple[int],
    **params: Any,
) -> tuple[jax.Array, int]:
    (x,), (dim,) = args, dims
    # Put the batch axis right after the placement axis, which is the leading unbatched axis.
    x = jnp.moveaxis(x, dim, 1)
    return primitive.bind(x, **params), 0


def _reduction_primitive(
    name: str,
    dtype_of: Callable[[np.dtype], np.dtype],
    reduce: Callable[[jax.Array], jax.Array],
) -> jex_core.Primitive:
    """The reduction primitive `name`: its impl, abstract eval, lowering and batching rule.

    Its result has dtype `dtype_of(x.dtype)` and lowers to `reduce(x)` (over axis 0), whatever
    the params; its transpose is registered by the caller.
    """
    primitive = jex_core.Primitive(name)
    primitive.def_impl(functools.partial(xla.apply_primitive, primitive))

    def abstract_eval(x: Any, *, placement: str, size: Size, mesh: AnyMesh | None) -> Any:
        del mesh  # Unused.
        _check_placed_aval(x, placement, size, name)
        return _reduced_aval(x, dtype_of(x.dtype))

    def lowering_fn(x: jax.Array, **params: Any) -> jax.Array:
        del params  # Unused.
        return reduce(x)

    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, mlir.lower_fun(lowering_fn, multiple_results=False))
    batching.primitive_batchers[primitive] = functools.partial(_reduction_batch, primitive)
    return primitive


def _cotangent_mesh(x: Any, placement: str) -> AnyMesh | None:
    """The broadcast mesh that gives a cotangent the type of the reduced input `x`.

    The cotangent is typed sharded along `placement` exactly when `x` was, whatever mesh the
    reduction was given: placed values may come unsharded from outside an Explicit mesh, or
    sharded by an earlier `map_fn(mesh=...)`.
    """
    sharding = x.aval.sharding
    return sharding.mesh if sharding.spec and sharding.spec[0] == placement else None


# --- placed_sum -------------------------------------------------------------------------------

sum_p = _reduction_primitive(
    "placed_sum", sum_dtype, lambda x: jnp.sum(x, axis=0, dtype=sum_dtype(x.dtype))
)


def placed_sum(x: jax.Array, *, placement: str, size: Size, mesh: AnyMesh | None) -> Any:
    """Binds `placed_sum`: the sum over the leading placement axis."""
    return sum_p.bind(x, placement=placement, size=size, mesh=mesh)


def _sum_transpose(ct: Any, x: Any, *, placement: str, size: Size, mesh: Any) -> list[Any]:
    mesh = _cotangent_mesh(x, placement)
    return [placed_broadcast(ct, placement=placement, size=size, mesh=mesh)]


ad.deflinear2(sum_p, _sum_transpose)


# --- placed_mean ------------------------------------------------------------------------------

# No dtype= in the lowering: jnp.mean then accumulates float16 / bfloat16 in float32 (as torch
# does), where a sum in the value's own dtype would overflow.
mean_p = _reduction_primitive(
    "placed_mean", mean_dtype, lambda x: jnp.mean(x, axis=0).astype(mean_dtype(x.dtype))
)


def placed_mean(x: jax.Array, *, placement: str, size: Size, mesh: AnyMesh | None) -> Any:
    """Binds `placed_mean`: the mean over the leading placement axis (ints give floats)."""
    return mean_p.bind(x, placement=placement, size=size, mesh=mesh)


def _mean_transpose(ct: Any, x: Any, *, placement: str, size: Size, mesh: Any) -> list[Any]:
    mesh = _cotangent_mesh(x, placement)
    placed = placed_broadcast(ct, placement=placement, size=size, mesh=mesh)
    # jnp.asarray turns a symbolic size into its value at run time (a constant for an int).
    return [placed / jnp.asarray(size, dtype=placed.dtype)]


ad.deflinear2(mean_p, _mean_transpose)
