"""`map_reduce`: a round (broadcast → per-client map → reduce) run by one of three strategies.

All strategies compute the same values and gradients; they differ in speed and memory:

* "vmap": every client at once (`broadcast`, `map_fn`, a `reduce_*`): fastest for small dense
  models, memory proportional to the number of clients.
* "per_client": the single-client program in a `lax.scan` over clients, the reduction in the
  carry: the memory of one client, and no grouped convolutions (vmap turns a convolution over
  per-client weights into one). The loop body is under `jax.checkpoint`, so gradients keep that
  memory bound (recomputing each client's forward once in the backward pass).
* "chunks": `chunk_size` clients vmapped at a time in a `lax.scan` over chunks carrying the
  partial reduction (for the weighted mean: the weighted sum and the weight sum), the body under
  `jax.checkpoint`, the last chunk padded with copies of the last client and masked out:
  peak memory O(chunk_size · per-client size) whatever the number of clients, forward and
  gradient alike. (`lax.map(batch_size=...)` does not bound memory this way: its gradient keeps
  every chunk's residuals.)
* "packed": "chunks" whose `chunk_size` clients run packed into their channels
  (`vmap_packed`): a convolution over per-client kernels runs as one dense convolution of the
  block-diagonal kernel, and the activations stay packed from one layer to the next. G times a
  convolution's arithmetic in G times fewer, wider products: for small CNNs on a TPU (see
  docs/performance.md); a NaN in one client's activations spreads to its chunk. Without
  convolutions it is "chunks".

For CPU programs (`program_platform()`) the client function runs through `canonical_layouts`:
its convolutions, which the loops of "per_client" and "chunks" (and a scan of local steps
inside `fn`) would otherwise keep out of XLA:CPU's fast layout.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr.typing import PyTree, Reduction, Strategy

from . import _primitives
from ._api import broadcast, map_fn, reduce_mean, reduce_sum, reduce_weighted_mean
from ._arguments import (
    CHUNKED,
    ArrayResults,
    check_arguments,
    check_loopable,
    check_server,
    check_weights,
    client_count,
)
from ._layouts import canonical_layouts, program_platform
from ._mesh import AnyMesh, placement_mesh
from ._packed import vmap_packed
from ._program import Placement, program


def map_reduce(
    fn: Callable[[PyTree, PyTree], PyTree],
    server: PyTree,
    clients: PyTree,
    *,
    reduce: Reduction = "mean",
    weights: PyTree | None = None,
    placement: str = "clients",
    mesh: AnyMesh | None = None,
    strategy: Strategy = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """Runs `fn(server, client)` for every client and reduces the results over the clients.

    The round is self-contained: it runs under its own placement, named `placement` and sized
    by the clients' leading dimension (an active `program` is neither needed nor consulted), so
    it means the same inside and outside a program. The server value enters every client's
    computation unbatched. `strategy` only changes how the clients run (see the module
    docstring): values and gradients agree to rounding.

    Sharding: with a mesh that has the placement axis (`mesh`, else `jax.set_mesh` or a legacy
    `with mesh:`), "vmap" shards the clients over it as `map_fn` does. With an Auto placement
    axis, "chunks" shards each chunk's clients over it (and the clients' data, chunk by chunk,
    the same way), and "per_client" runs one client per device at a time (chunks of the axis
    size) so that no device idles. An Explicit placement axis is supported by "vmap" only.

    Args:
        fn: A JAX function of (server value, one client's slice of `clients`) returning a JAX
            array or a pytree of them.
        server: A pytree of JAX arrays (or numbers) that every client receives.
        clients: A pytree of arrays whose leading dimension (the same for every leaf) is the
            clients axis.
        reduce: "mean", "sum" or "weighted_mean" (sum(x·w) / sum(w)).
        weights: For "weighted_mean": one weight per client (shape [n]), or a pytree shaped like
            `fn`'s output with the clients axis first.
        placement: The name of the clients axis, as in `program` and meshes.
        mesh: The mesh to shard the clients over; None uses the mesh set with `jax.set_mesh`.
        strategy: "vmap", "per_client", "chunks" or "packed".
        chunk_size: For "chunks" and "packed": how many clients run at once (a positive int;
            one larger than the number of clients means a single chunk).

    Returns:
        The reduction of `fn`'s results over the clients, with `fn`'s output structure.

    Raises:
        ValueError: A bad `reduce`, `strategy`, `chunk_size` or `weights`, no clients, clients
            that disagree on their count, "per_client" / "chunks" / "packed" with a symbolic
            client count or an Explicit placement axis, "packed" on a mesh with the placement.
        TypeError: `fn` is not callable or returns non-arrays, a leaf is not an array, or `mesh`
            is not a mesh.

    Example:
        >>> from bridge_mr import jax_core as mr
        >>> xs = jnp.arange(10.0).reshape(5, 2)  # 5 clients, 2 values each
        >>> scaled_sum = lambda w, x: jnp.sum(w * x)  # fn(server, one client's slice)
        >>> mr.map_reduce(scaled_sum, jnp.float32(2.0), xs)  # strategy="vmap": all at once
        Array(18., dtype=float32)
        >>> mr.map_reduce(scaled_sum, jnp.float32(2.0), xs, strategy="chunks", chunk_size=2)
        Array(18., dtype=float32)
        >>> mr.map_reduce(scaled_sum, jnp.float32(2.0), xs, reduce="sum", strategy="per_client")
        Array(90., dtype=float32)
    """
    check_arguments(fn, reduce, weights, placement, mesh, strategy, chunk_size)
    n = client_count(clients)
    check_server(server)
    if weights is not None:
        check_weights(weights, n)
    client_fn = ArrayResults(fn)
    if program_platform() == "cpu":
        client_fn = canonical_layouts(client_fn)
    with program(placements={placement: n}) as where:
        if strategy == "vmap":
            return _vmapped(client_fn, server, clients, weights, reduce, mesh)
        placed_on = placement_mesh(mesh, where, caller="map_reduce")
        check_loopable(where, placed_on, strategy)
        if strategy in CHUNKED:
            assert chunk_size is not None  # check_arguments insists.
            size, batched = min(chunk_size, n), True
        elif placed_on is not None:
            size, batched = min(placed_on.shape[placement], n), True
        else:
            size, batched = 1, False
        server = jax.tree.map(jnp.asarray, server)  # Arrays, as `broadcast` makes them.
        if strategy == "packed" and placed_on is not None:
            raise ValueError(
                f"map_reduce(strategy='packed') packs each chunk's clients into one device's "
                f"channels, so it cannot shard them over the mesh axis {placement!r} (mesh axes "
                f"{dict(placed_on.shape)}). Use strategy='chunks' to shard, or no mesh."
            )
        return _looped(
            client_fn,
            server,
            clients,
            weights,
            reduce,
            where,
            (mesh, placed_on),
            size,
            (batched, strategy == "packed"),
        )


def _vmapped(
    fn: Callable[[PyTree, PyTree], PyTree],
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: str,
    mesh: AnyMesh | None,
) -> PyTree:
    """Strategy "vmap": broadcast → map_fn → reduce_*, under the active placement."""
    placed = broadcast(server, mesh=mesh)
    results = map_fn(fn, (placed, clients), mesh=mesh)
    if reduce == "sum":
        return reduce_sum(results)
    if reduce == "mean":
        return reduce_mean(results)
    if mesh is not None:
        # Placed like the results: the reduction cannot see `mesh`, and an Explicit mesh
        # refuses to combine values sharded along the placement with unsharded ones.
        weights = map_fn(lambda w: w, weights, mesh=mesh)
    return reduce_weighted_mean(results, weights)


def _looped(
    fn: Callable[[PyTree, PyTree], PyTree],
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: str,
    where: Placement,
    meshes: tuple[AnyMesh | None, AnyMesh | None],
    size: int,
    forms: tuple[bool, bool],
) -> PyTree:
    """Strategies "per_client" (size 1, unbatched), "chunks" and "packed": a scan over chunks.

    `forms` is (batched, packed). Each step runs `size` clients (vmapped when batched, through
    `vmap_packed` when packed too) and adds their masked contributions
    to the carry: one sum per output leaf (and, for the weighted mean, the weight sums).
    `meshes` are the `mesh=` argument (for `map_fn`) and the mesh it resolved to, if any.
    """
    mesh, placed_on = meshes
    batched, packed = forms
    n = where.size
    assert isinstance(n, int)  # check_loopable refused symbolic sizes.
    steps = -(-n // size)
    padded = steps * size

    def chunked(leaf: jax.Array) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if padded != n:  # Copies of the last client: real data, so no NaN to mask away.
            leaf = leaf[np.minimum(np.arange(padded), n - 1)]
        if not batched:
            return leaf
        leaf = leaf.reshape(steps, size, *leaf.shape[1:])
        if placed_on is not None:
            spec = P(None, where.name, *([P.UNCONSTRAINED] * (leaf.ndim - 2)))
            leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(placed_on, spec))
        return leaf

    one_client = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    out_avals, out_def = jax.tree.flatten(jax.eval_shape(fn, server, one_client))
    weight_def = jax.tree.structure(weights)
    shared_weight = weight_def.num_leaves == weight_def.num_nodes == 1
    if weights is not None and not shared_weight and weight_def != out_def:
        raise ValueError(
            f"map_reduce(weights): expected one weight array (shape [{n}]) or a pytree with "
            f"the structure of fn's output ({out_def}); got {weight_def}. Pass a single "
            "per-client weight vector, or weights shaped like the values."
        )
    accumulation = _Accumulation(reduce, out_avals, jax.tree.leaves(weights))
    mask = None if padded == n else np.arange(padded).reshape(steps, size) < n
    xs = (
        jax.tree.map(chunked, clients),
        [chunked(w) for w in jax.tree.leaves(weights)],
        mask,
    )

    def step(carry: list[jax.Array], x: tuple[Any, Any, Any]) -> tuple[list[jax.Array], None]:
        chunk, chunk_weights, chunk_mask = x
        if packed:
            results = vmap_packed(lambda c: fn(server, c), size)(chunk)
        elif batched:
            with program(placements={where.name: size}):
                # A 1-tuple: map_fn unpacks a tuple argument, and `chunk` may be one.
                results = map_fn(lambda c: fn(server, c), (chunk,), mesh=mesh)
        else:
            results = fn(server, chunk)
        parts = accumulation.contributions(
            jax.tree.leaves(results), chunk_weights, chunk_mask, batched
        )
        return [total + part for total, part in zip(carry, parts, strict=True)], None

    totals, _ = jax.lax.scan(jax.checkpoint(step), accumulation.zeros(), xs)
    return jax.tree.unflatten(out_def, accumulation.finish(totals, n))


class _Accumulation:
    """What the loop accumulates per output leaf, in which dtype, and how it finishes.

    The carry holds one sum per output leaf and, for the weighted mean, the weight sums (one
    for a weight array shared by every leaf, else one per leaf). Low-precision floats
    accumulate in float32.
    """

    def __init__(self, reduce: str, out_avals: list[Any], weight_leaves: list[Any]) -> None:
        self.reduce = reduce
        self.count = len(out_avals)
        self.shared_weight = len(weight_leaves) == 1
        # Per output leaf: its weight's per-client shape and dtype (weighted mean only).
        weights = [(tuple(w.shape[1:]), np.dtype(w.dtype)) for w in weight_leaves]
        self.weights = weights * self.count if self.shared_weight else weights
        if reduce == "weighted_mean":
            for aval, (shape, _) in zip(out_avals, self.weights, strict=True):
                if len(shape) > len(aval.shape):
                    raise ValueError(
                        f"reduce_weighted_mean(w): a weight slice of shape {shape} has more "
                        f"dimensions than its value slice {aval.shape}; weights must be "
                        "per-client scalars or shaped like the values."
                    )
            self.dtypes = [
                jax.eval_shape(operator.mul, aval, jax.ShapeDtypeStruct(*weight)).dtype
                for aval, weight in zip(out_avals, self.weights, strict=True)
            ]
        elif reduce == "sum":
            self.dtypes = [_primitives.sum_dtype(aval.dtype) for aval in out_avals]
        else:
            self.dtypes = [_primitives.mean_dtype(aval.dtype) for aval in out_avals]
        self.sums = [
            (aval.shape, _accumulator(dtype))
            for aval, dtype in zip(out_avals, self.dtypes, strict=True)
        ]
        weight_sums = self.weights[:1] if self.shared_weight else self.weights
        self.sums += [(s, _accumulator(_primitives.sum_dtype(d))) for s, d in weight_sums]

    def zeros(self) -> list[jax.Array]:
        """The carry before the first client."""
        return [jnp.zeros(shape, dtype) for shape, dtype in self.sums]

    def contributions(
        self, results: list[jax.Array], weights: list[jax.Array], mask: Any, batched: bool
    ) -> list[jax.Array]:
        """One step's additions to the carry, padded clients (`mask` False) left out."""
        values = list(results)
        if self.reduce == "weighted_mean":
            per_leaf = weights * self.count if self.shared_weight else weights
            values = [x * _left_aligned(w, x) for x, w in zip(values, per_leaf, strict=True)]
            values += weights
        parts = []
        for value, (_, dtype) in zip(values, self.sums, strict=True):
            value = value.astype(dtype)
            if mask is not None:
                value = jnp.where(_left_aligned(mask, value), value, jnp.zeros((), dtype))
            parts.append(value.sum(axis=0, dtype=dtype) if batched else value)
        return parts

    def finish(self, totals: list[jax.Array], n: int) -> list[jax.Array]:
        """The reduced values from the carried sums."""
        sums = totals[: self.count]
        if self.reduce == "sum":
            return [s.astype(d) for s, d in zip(sums, self.dtypes, strict=True)]
        if self.reduce == "mean":
            return [(s / n).astype(d) for s, d in zip(sums, self.dtypes, strict=True)]
        dens = totals[self.count :] * (self.count if self.shared_weight else 1)
        return [
            (num / _left_aligned(den, num)).astype(
                jnp.result_type(dtype, _primitives.sum_dtype(w_dtype))
            )
            for num, den, dtype, (_, w_dtype) in zip(
                sums, dens, self.dtypes, self.weights, strict=True
            )
        ]


def _accumulator(dtype: Any) -> Any:
    """Low-precision floats accumulate in float32 (as `jnp.mean` does); others in their dtype."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _left_aligned(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w` with trailing unit dimensions, to scale `x` slice by slice from the left."""
    return w.reshape(w.shape + (1,) * (x.ndim - w.ndim))
