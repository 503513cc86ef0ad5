"""The MapReduce API over the active placement: broadcast, map_fn and the reductions.

Semantics follow drjax 0.2.x: placed values carry the placement axis first; `map_fn` unpacks a
tuple argument into positional arguments; the weighted mean is sum(x·w) / sum(w).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias, cast

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr.typing import PyTree

from . import _primitives
from ._maps import trace_map
from ._mesh import AnyMesh, abstract, axis_type, placement_mesh
from ._program import (
    BroadcastSources,
    Placement,
    keeps_maps,
    require_broadcasts,
    require_placement,
)


def _as_array(leaf: Any, *, argument: str, path: tuple[Any, ...]) -> jax.Array:
    if isinstance(leaf, jax.Array):
        return leaf
    try:
        return jnp.asarray(leaf)
    except TypeError as err:
        raise TypeError(
            f"{argument}{jax.tree_util.keystr(path)}: expected a JAX array or a value "
            f"convertible to one; got {type(leaf).__name__}: {leaf!r}. Torch tensors go "
            "through bridge_mr.broadcast / bridge_mr.map_reduce (the top-level names)."
        ) from err


def _placed_leaves(
    tree: PyTree, placement: Placement, *, argument: str
) -> tuple[list[jax.Array], Any]:
    """Flattens `tree`, checking every leaf carries the placement axis first."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in path_leaves:
        array = _as_array(leaf, argument=argument, path=path)
        if array.ndim == 0 or array.shape[0] != placement.size:
            got = "a 0-d value" if array.ndim == 0 else f"leading dimension {array.shape[0]}"
            raise ValueError(
                f"{argument}{jax.tree_util.keystr(path)}: expected a placed value whose leading "
                f"dimension is the {placement.name!r} size {placement.size}; got {got} (shape "
                f"{array.shape}). Place it first with broadcast() or map_fn(), or run under "
                f"program(placements={{{placement.name!r}: {array.shape[0] if array.ndim else 'n'}"
                "}) if the size is wrong."
            )
        leaves.append(array)
    return leaves, treedef


def broadcast(x: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Places every leaf of `x` at the active placement: a new leading axis of its size.

    With a mesh that has an axis named like the placement (`mesh`, `jax.set_mesh` or the legacy
    `with mesh:`), the result is sharded along it and the other dimensions keep the sharding of
    the input. With a mesh without that axis (Auto or Explicit), the placement axis is unsharded
    and the other dimensions again keep the input's sharding. A mesh may mix Auto and Explicit
    axes: the placement axis's type decides whether placed values are typed sharded (Explicit)
    or only constrained for the partitioner (Auto).

    Args:
        x: A pytree of JAX arrays (or values convertible to them).
        mesh: The mesh to shard the placement axis over; None uses the mesh set with
            `jax.set_mesh` (or the legacy `with mesh:`), if any.

    Returns:
        `x` with every leaf repeated along a new leading axis of the placement's size.

    Raises:
        RuntimeError: Outside any `program`.
        TypeError: A leaf is not convertible to a JAX array, or `mesh` is not a mesh.
        ValueError: An Explicit placement axis of the mesh does not divide the placement size.

    Example:
        >>> from bridge_mr import jax_core as mr
        >>> with mr.program(placements={"clients": 8}):
        ...     placed = mr.broadcast({"w": jnp.ones((3, 2))})
        >>> placed["w"].shape, placed["w"].dtype
        ((8, 3, 2), dtype('float32'))
    """
    placement = require_placement("broadcast")
    broadcasts = require_broadcasts("broadcast")
    mesh = placement_mesh(mesh, placement, caller="broadcast")
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    sources = [_as_array(leaf, argument="broadcast(x)", path=path) for path, leaf in path_leaves]
    placed = [
        _primitives.placed_broadcast(
            source,
            placement=placement.name,
            size=placement.size,
            mesh=_explicit_only(mesh, placement.name),
        )
        for source in sources
    ]
    if mesh is not None and axis_type(mesh, placement.name) != AxisType.Explicit:
        placed = [_constrain_placed(leaf, mesh, placement.name) for leaf in placed]
    for leaf, source in zip(placed, sources, strict=True):
        broadcasts.record(leaf, source)
    return jax.tree_util.tree_unflatten(treedef, placed)


def _explicit_only(mesh: AnyMesh | None, placement: str) -> AnyMesh | None:
    """The primitives' `mesh` param: only an Explicit placement axis enters the types."""
    if mesh is None or axis_type(mesh, placement) != AxisType.Explicit:
        return None
    return mesh


def _constrain_placed(x: jax.Array, mesh: AnyMesh, placement: str) -> jax.Array:
    """Pins the leading axis to `placement` (Auto mesh); other axes follow propagation."""
    spec = P(placement, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def reduce_sum(x: PyTree) -> PyTree:
    """Sums every leaf of the placed value `x` over its leading placement axis.

    Args:
        x: A placed pytree: every leaf's leading dimension is the placement size.

    Returns:
        The sums, leaf by leaf, in the leaf's dtype (bools count in the default int dtype).

    Raises:
        RuntimeError: Outside any `program`.
        ValueError: A leaf is 0-d or its leading dimension is not the placement size.

    Example:
        >>> from bridge_mr import jax_core as mr
        >>> with mr.program(placements={"clients": 3}):
        ...     total = mr.reduce_sum(jnp.arange(6.0).reshape(3, 2))  # rows [0, 1], [2, 3], [4, 5]
        >>> total
        Array([6., 9.], dtype=float32)
    """
    return _reduce(_primitives.placed_sum, x, "reduce_sum")


def reduce_mean(x: PyTree) -> PyTree:
    """Averages every leaf of the placed value `x` over its leading placement axis.

    Args:
        x: A placed pytree: every leaf's leading dimension is the placement size.

    Returns:
        The means, leaf by leaf. Integer and bool leaves give the default float dtype.

    Raises:
        RuntimeError: Outside any `program`.
        ValueError: A leaf is 0-d or its leading dimension is not the placement size.

    Example:
        A pytree of placed values, each averaged; integers give floats:

        >>> from bridge_mr import jax_core as mr
        >>> updates = {"w": jnp.arange(6.0).reshape(3, 2), "steps": jnp.array([1, 2, 6])}
        >>> mr.program(placements={"clients": 3})(mr.reduce_mean)(updates)
        {'steps': Array(3., dtype=float32), 'w': Array([2., 3.], dtype=float32)}
    """
    return _reduce(_primitives.placed_mean, x, "reduce_mean")


def _reduce(reduction: Callable[..., jax.Array], x: PyTree, name: str) -> PyTree:
    placement = require_placement(name)
    mesh = _explicit_only(placement_mesh(None, placement, caller=name), placement.name)
    leaves, treedef = _placed_leaves(x, placement, argument=f"{name}(x)")
    reduced = [
        reduction(leaf, placement=placement.name, size=placement.size, mesh=mesh) for leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, reduced)


def reduce_weighted_mean(x: PyTree, w: PyTree) -> PyTree:
    """The weighted mean sum(x·w) / sum(w) over the placement axis, leaf by leaf.

    x·w is an elementwise product aligned from the left (what drjax computes with a `map_fn`,
    without the vmap).

    Args:
        x: A placed pytree: every leaf's leading dimension is the placement size.
        w: One placed array (shape [n], or broadcastable against each leaf's slices from the
            left) used for every leaf of `x`, or a placed pytree with the structure of `x`.

    Returns:
        The weighted means, leaf by leaf.

    Raises:
        RuntimeError: Outside any `program`.
        ValueError: A leading dimension is not the placement size, `w` has neither one leaf
            nor the structure of `x`, or a weight slice has more dimensions than its value's.

    Example:
        >>> from bridge_mr import jax_core as mr
        >>> with mr.program(placements={"clients": 2}):
        ...     mean = mr.reduce_weighted_mean(jnp.asarray([1.0, 4.0]), jnp.asarray([3.0, 1.0]))
        >>> mean  # (1 * 3 + 4 * 1) / (3 + 1)
        Array(1.75, dtype=float32)
    """
    placement = require_placement("reduce_weighted_mean")
    # The sums' mesh errors then name reduce_weighted_mean.
    total = functools.partial(_reduce, _primitives.placed_sum, name="reduce_weighted_mean")
    x_leaves, x_def = _placed_leaves(x, placement, argument="reduce_weighted_mean(x)")
    w_def = jax.tree_util.tree_structure(w)
    if w_def.num_leaves == 1 and w_def.num_nodes == 1:
        (w_leaf,), _ = _placed_leaves(w, placement, argument="reduce_weighted_mean(w)")
        w_leaves = [w_leaf] * len(x_leaves)
        denominators = total([w_leaf]) * len(x_leaves)  # One sum serves every leaf.
    elif w_def == x_def:
        w_leaves, _ = _placed_leaves(w, placement, argument="reduce_weighted_mean(w)")
        denominators = total(w_leaves)
    else:
        raise ValueError(
            "reduce_weighted_mean(w): expected one placed weight array (shape "
            f"[{placement.size}]) or a pytree with the structure of x ({x_def}); got {w_def}. "
            "Pass a single per-client weight vector, or weights shaped like the values."
        )
    products = [x * _weight_slice(w, x) for x, w in zip(x_leaves, w_leaves, strict=True)]
    numerators = total(products)
    means = [
        num / _weight_slice(den, num) for num, den in zip(numerators, denominators, strict=True)
    ]
    return jax.tree_util.tree_unflatten(x_def, means)


def _weight_slice(w: jax.Array, x: jax.Array) -> jax.Array:
    """Aligns weight `w` against value `x` from the left (a per-client weight scales its slice)."""
    if w.ndim > x.ndim:
        raise ValueError(
            f"reduce_weighted_mean(w): a weight slice of shape {w.shape} has more dimensions "
            f"than its value slice {x.shape}; weights must be per-client scalars or shaped like "
            "the values."
        )
    w = w.reshape(w.shape + (1,) * (x.ndim - w.ndim))
    # Explicit axes: a weight typed otherwise than its value breaks the product's transpose, so
    # give each weight dimension the sharding of the value's, except where the weight broadcasts
    # (size 1, e.g. a per-client scalar or the summed weight, which cannot be sharded).
    spec = tuple(
        entry if w_size == x_size else None
        for entry, w_size, x_size in zip(_full_spec(x), w.shape, x.shape, strict=True)
    )
    if spec != _full_spec(w):
        # A value from outside any mesh has an empty one; the weight's then gives the layout.
        mesh = jax.typeof(x).sharding.mesh
        mesh = jax.typeof(w).sharding.mesh if mesh.empty else mesh
        w = jax.sharding.reshard(w, NamedSharding(mesh, P(*spec)))
    return w


def _full_spec(x: jax.Array) -> tuple[Any, ...]:
    """The sharding spec of `x`'s type, one entry per dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def map_fn(fn: Callable[..., PyTree], arg: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Applies `fn` to each slice of `arg` along the placement axis (a tuple `arg` is unpacked).

    With a mesh that has the placement axis, inputs and outputs are sharded along it and
    shardings inside `fn` (constraints, `shard_map`, model-parallel layouts) are kept: `fn` is
    vmapped with the placement as its SPMD axis.

    A leaf of `arg` that is itself an output of `broadcast` in the same program (the very
    object, not a value computed from it) enters the map unbatched: `fn` sees the broadcast's
    input, as `jax.vmap(fn, in_axes=None)` would pass it, so the parameters of a FedSGD round
    are not repeated per client and their gradient is not a sum of per-client copies. Values,
    gradients of every order, `vmap` of the program and output shardings are the same as for
    the placed value; the unbatched input keeps its own sharding.

    Args:
        fn: A function of one placement slice (of several, for a tuple `arg`).
        arg: A placed pytree, or a tuple of them (unpacked into `fn`'s positional arguments).
        mesh: As for `broadcast`.

    Returns:
        `fn`'s results for every slice, stacked along a leading placement axis (also for
        results that depend only on unbatched inputs, which are repeated).

    Raises:
        RuntimeError: Outside any `program`.
        TypeError: `fn` is not callable, a leaf is not convertible to a JAX array, or `mesh`
            is not a mesh.
        ValueError: A leaf's leading dimension is not the placement size, or an Explicit
            placement axis of the mesh does not divide it.

    Example:
        >>> from bridge_mr import jax_core as mr
        >>> with mr.program(placements={"clients": 3}):
        ...     norms = mr.map_fn(jnp.linalg.norm, jnp.ones((3, 4)))
        ...     w = mr.broadcast(jnp.float32(2.0))  # enters the map unbatched
        ...     scaled = mr.map_fn(jnp.multiply, (w, norms))  # a tuple: fn(w_i, norms_i)
        >>> norms, scaled
        (Array([2., 2., 2.], dtype=float32), Array([4., 4., 4.], dtype=float32))
    """
    placement = require_placement("map_fn")
    if not callable(fn):
        raise TypeError(
            f"map_fn(fn, arg): fn must be callable (it is applied to each of the "
            f"{placement.size} {placement.name!r} slices); got {type(fn).__name__}: {fn!r}."
        )
    broadcasts = require_broadcasts("map_fn")
    mesh = placement_mesh(mesh, placement, caller="map_fn")
    leaves, treedef = _placed_leaves(arg, placement, argument="map_fn(arg)")
    kind = None if mesh is None else axis_type(mesh, placement.name)
    place, share = _placers(mesh, kind, placement.name)
    values, axes = [], []
    for leaf in leaves:
        source = _unbatched_source(broadcasts, leaf)
        values.append(place(leaf) if source is None else share(source))
        axes.append(0 if source is None else None)
    arg, in_axes = jax.tree_util.tree_unflatten(treedef, values), treedef.unflatten(axes)
    args, in_axes = (tuple(arg), tuple(in_axes)) if isinstance(arg, tuple) else ((arg,), (in_axes,))
    if keeps_maps() and mesh is None:
        return trace_map(fn, args, in_axes, placement.name, placement.size)
    mapped = jax.vmap(
        fn,
        in_axes=in_axes,
        # A map whose every input is unbatched still has the placement axis: vmap repeats
        # such results. vmap's annotation says int; a symbolic size works as in any shape.
        axis_size=cast(int, placement.size),
        # Auto axes: constraints and shard_map inside `fn` keep their model axes.
        spmd_axis_name=placement.name if kind == AxisType.Auto else None,
    )(*args)
    return jax.tree.map(place, mapped)


_Place: TypeAlias = Callable[[jax.Array], jax.Array]


def _placers(mesh: AnyMesh | None, kind: AxisType | None, placement: str) -> tuple[_Place, _Place]:
    """How `map_fn` places its batched values (inputs and outputs) and its unbatched inputs.

    Auto placement axis: a constraint along `placement`, and nothing (inputs keep their own
    sharding). Explicit: a reshard to it, and the type a slice of the placed value would have.
    No mesh: nothing.
    """
    if mesh is None:
        return _unchanged, _unchanged
    if kind == AxisType.Explicit:
        return (
            functools.partial(_reshard_placed, mesh=abstract(mesh), placement=placement),
            functools.partial(_type_as_slice, mesh=abstract(mesh), placement=placement),
        )
    return functools.partial(_constrain_placed, mesh=mesh, placement=placement), _unchanged


def _unchanged(x: jax.Array) -> jax.Array:
    return x


def _unbatched_source(broadcasts: BroadcastSources, leaf: jax.Array) -> jax.Array | None:
    """The input `leaf` was broadcast from, to map unbatched; None to map `leaf` batched."""
    source = broadcasts.source(leaf)
    if source is not None and not isinstance(leaf, Tracer) and leaf.is_deleted():
        return None  # A donated placed value: mapping it raises JAX's own error.
    return source


def _type_as_slice(x: jax.Array, mesh: AbstractMesh, placement: str) -> jax.Array:
    """Types an unbatched input as a slice of its placed value would be (Explicit mesh).

    That is `mesh` and the input's own spec without the placement axis. A transpose then types
    the input's cotangent on `mesh` too: a contraction over the clients (sharded along the
    placement) into a value typed on no mesh is ambiguous, and JAX refuses it.
    """
    sharding = jax.typeof(x).sharding
    spec = P(*(None if _uses_axis(s, placement) else s for s in sharding.spec))
    if sharding.mesh == mesh and sharding.spec == spec:
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _reshard_placed(x: jax.Array, mesh: AbstractMesh, placement: str) -> jax.Array:
    """Types `x` sharded along `placement` first (Explicit mesh), the rest as it was."""
    spec = jax.typeof(x).sharding.spec
    if spec and spec[0] == placement:
        return x
    rest = [None if _uses_axis(s, placement) else s for s in spec[1:]]
    return jax.sharding.reshard(x, NamedSharding(mesh, P(placement, *rest)))


def _uses_axis(entry: Any, name: str) -> bool:
    return entry == name or (isinstance(entry, tuple) and name in entry)
