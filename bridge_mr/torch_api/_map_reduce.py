"""`map_reduce`: broadcast → per-client map → reduce as one compiled, differentiable call."""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias

import jax
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import jax_core

from ._function import TorchFunction

PyTree: TypeAlias = Any
Reduction: TypeAlias = Literal["mean", "sum", "weighted_mean"]
_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "weighted_mean")


class ClientFn(Protocol):
    """A JAX function of (server value, one client's slice) returning a pytree of arrays."""

    def __call__(self, server: PyTree, client: PyTree) -> PyTree: ...


def map_reduce(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    *,
    reduce: Reduction = "mean",
    weights: PyTree | None = None,
    placement: str = "clients",
    mesh: Mesh | AbstractMesh | None = None,
) -> PyTree:
    """Broadcasts `server` to every client, maps `fn(server, client)` over clients, reduces.

    The number of clients is the leading dimension of every leaf of `clients`. `fn` is a JAX
    function; `reduce` is "mean", "sum" or "weighted_mean" (sum(x·w) / sum(w) with `weights`,
    one weight per client, shape [n], or a pytree shaped like `fn`'s output). With torch tensors
    the whole round is one compiled program and one autograd node: gradients reach both
    `server` and `clients` (e.g. `dict(model.named_parameters())` as `server`). With JAX arrays
    only, it is the JAX program itself. `mesh` (or `jax.set_mesh`) shards the clients over its
    `placement` axis.
    """
    if reduce not in _REDUCTIONS:
        raise ValueError(
            f"map_reduce(reduce=...): expected one of {', '.join(map(repr, _REDUCTIONS))}; got "
            f"{reduce!r}."
        )
    if reduce == "weighted_mean" and weights is None:
        raise ValueError(
            "map_reduce(reduce='weighted_mean') needs weights=: one weight per client (a "
            "tensor of shape [n_clients]), e.g. the clients' example counts."
        )
    if reduce != "weighted_mean" and weights is not None:
        raise ValueError(
            f"map_reduce(weights=...) was given with reduce={reduce!r}, which ignores weights. "
            "Pass reduce='weighted_mean' to use them, or drop weights."
        )
    if not callable(fn):
        raise TypeError(
            f"map_reduce(fn, ...): fn must be a JAX function of (server, client); got "
            f"{type(fn).__name__}: {fn!r}."
        )
    if not isinstance(placement, str) or not placement:
        raise TypeError(
            f"map_reduce(placement=...): expected a non-empty str such as 'clients'; got "
            f"{type(placement).__name__}: {placement!r}."
        )
    return _MAP_REDUCE(fn, server, clients, weights, reduce, placement, mesh)


def map_reduce_program(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
) -> PyTree:
    """The JAX program behind `map_reduce` (arguments as there, all positional)."""
    n = _client_count(clients)
    with jax_core.program(placements={placement: n}):
        placed = jax_core.broadcast(server, mesh=mesh)
        results = jax_core.map_fn(_ArrayResults(fn), (placed, clients), mesh=mesh)
        if reduce == "sum":
            return jax_core.reduce_sum(results)
        if reduce == "mean":
            return jax_core.reduce_mean(results)
        _check_weights(weights, n)
        if mesh is not None:
            # Placed like the results: the reduction cannot see `mesh`, and an Explicit mesh
            # refuses to combine values sharded along the placement with unsharded ones.
            weights = jax_core.map_fn(lambda w: w, weights, mesh=mesh)
        return jax_core.reduce_weighted_mean(results, weights)


_MAP_REDUCE = TorchFunction(
    map_reduce_program,
    passthrough_jax=True,
    name="map_reduce",
    arg_names=("fn", "server", "clients", "weights", "reduce", "placement", "mesh"),
)


class _ArrayResults:
    """Calls the client function, insisting that it returns arrays only."""

    def __init__(self, fn: ClientFn) -> None:
        self._fn = fn

    def __call__(self, server: PyTree, client: PyTree) -> PyTree:
        result = self._fn(server, client)
        for path, leaf in jax.tree_util.tree_flatten_with_path(result)[0]:
            if not isinstance(leaf, jax.Array):
                raise TypeError(
                    f"map_reduce(fn): fn returned a non-array leaf at "
                    f"result{jax.tree_util.keystr(path)}: expected a JAX array, got "
                    f"{type(leaf).__name__}: {leaf!r}. Return jnp arrays (jnp.asarray(value))."
                )
        return result


def _client_count(clients: PyTree) -> int:
    path_leaves = jax.tree_util.tree_flatten_with_path(clients)[0]
    if not path_leaves:
        raise ValueError(
            "map_reduce(clients): expected a pytree of tensors with the clients axis first; got "
            "no tensors at all, so the number of clients is unknown."
        )
    sizes: dict[int, list[str]] = {}
    for path, leaf in path_leaves:
        name = "clients" + jax.tree_util.keystr(path)
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"map_reduce(clients): {name} has shape {shape}; every client leaf needs the "
                "clients axis first (shape [n_clients, ...])."
            )
        sizes.setdefault(shape[0], []).append(f"{name} {tuple(shape)}")
    if len(sizes) > 1:
        listing = "; ".join(f"{n}: {', '.join(names[:3])}" for n, names in sizes.items())
        raise ValueError(
            "map_reduce(clients): the leaves disagree on the number of clients (their leading "
            f"dimension): {listing}. Every client leaf must have the clients axis first, with "
            "the same size."
        )
    return next(iter(sizes))


def _check_weights(weights: PyTree, n: int) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != n:
            raise ValueError(
                f"map_reduce(weights): weights{jax.tree_util.keystr(path)} has shape {shape}; "
                f"expected one weight per client, shape ({n},) (or [{n}, ...] shaped like fn's "
                "output)."
            )
