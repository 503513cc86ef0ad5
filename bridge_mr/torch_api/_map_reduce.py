"""`map_reduce`: broadcast → per-client map → reduce as one compiled, differentiable call."""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import jax_core

from . import _weights
from ._function import TorchFunction

PyTree: TypeAlias = Any
Reduction: TypeAlias = Literal["mean", "sum", "weighted_mean"]
_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "weighted_mean")


class ClientFn(Protocol):
    """A JAX function of (server value, one client's slice) returning a pytree of arrays."""

    def __call__(self, server: PyTree, client: PyTree, /) -> PyTree: ...


def map_reduce(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    *,
    reduce: Reduction = "mean",
    weights: PyTree | None = None,
    placement: str = "clients",
    mesh: Mesh | AbstractMesh | None = None,
    check_weights: bool = True,
) -> PyTree:
    """Broadcasts `server` to every client, maps `fn(server, client)` over clients, reduces.

    With torch tensors the whole round is one compiled program and one autograd node:
    gradients reach both `server` and `clients` (e.g. `dict(model.named_parameters())` as
    `server`). With JAX arrays only, it is the JAX program itself.

    Tracing: each distinct signature (tree structure, shapes, dtypes, devices, which tensors
    need gradients, JAX's configuration, the ambient mesh) is traced and compiled once. `fn` is
    part of that signature. A function re-created on every call (a lambda, a
    `functools.partial`, a bound method such as `trainer.loss`) reuses the trace of an earlier
    one when bridge_mr can compare everything it reads by value -- its code, the globals it
    reads, its defaults and captured values, a bound method's `self` -- that is, when these are
    numbers, strings, tuples of those, frozen dataclasses, immutable JAX / numpy arrays,
    modules, classes or other such functions. Otherwise (it reads a dict, a list, a mutable
    object such as a trainer, a torch tensor), it is traced again, as `jax.jit` would trace a
    new function object, and a `bridge_mr.RetraceWarning` says so after a few such traces. The
    JAX gotcha holds for the *same* function object: state it reads while tracing (an
    attribute, a dict entry) and then changes is not seen by later calls, with `jax.jit` as
    here. Pass values that change between calls, such as a learning rate, as tensors (in
    `server` or `clients`). `bridge_mr.trace_counts()` tells how often this has traced.

    Args:
      fn: a JAX function `fn(server, client)` of the server value and one client's slice of
        `clients`, returning a JAX array or a pytree of them.
      server: a pytree of torch tensors (or numbers), broadcast to every client.
      clients: a pytree of torch tensors whose leading dimension (the same for every leaf) is
        the clients axis.
      reduce: "mean", "sum" or "weighted_mean" (sum(x·w) / sum(w)).
      weights: for "weighted_mean": one weight per client (shape [n]), or a pytree shaped like
        `fn`'s output with the clients axis first.
      placement: the name of the clients axis, as in `program(placements=...)` and meshes.
      mesh: a mesh (or `jax.set_mesh`) whose `placement` axis the clients are sharded over.
      check_weights: check that the weights are finite and do not sum to zero (CPU tensors
        before the program; CUDA tensors by device reductions read after it, when the bridge
        waits for its results anyway; torch-xla tensors by one small device read before it).
        False gives raw IEEE results (NaN / inf) and skips that work.

    Returns:
      The reduction of `fn`'s results, with `fn`'s output structure: torch tensors for torch
      inputs, JAX arrays for JAX inputs.

    Raises:
      ValueError: bad `reduce`, `weights`, zero clients, clients that disagree on their count,
        or weights that are not finite or sum to zero.
      TypeError: `fn` not callable or returning non-arrays, leaves that are not tensors,
        tensors JAX cannot take (sparse, meta, unsupported dtypes), mixed torch and JAX inputs.

    Example:
      >>> params = dict(model.named_parameters())
      >>> loss = bridge_mr.map_reduce(client_loss, params, {"x": xs, "y": ys})  # xs: [n, ...]
      >>> loss.backward()  # gradients in model's .grad
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
    check_after = None
    if weights is not None and check_weights:
        check_after = _weights.check_weights(weights)
    result = MAP_REDUCE(fn, server, clients, weights, reduce, placement, mesh)
    if check_after is not None:
        check_after()
    return result


def map_reduce_jax(
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
    _check_server(server)
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


MAP_REDUCE = TorchFunction(
    map_reduce_jax,
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
        path_leaves = jax.tree_util.tree_flatten_with_path(result)[0]
        if not path_leaves:
            raise TypeError(
                f"map_reduce(fn): fn returned {result!r}, which holds no arrays; it must return "
                "a JAX array or a pytree of them (the client's loss, its model delta, ...). "
                "Did fn forget a `return`?"
            )
        for path, leaf in path_leaves:
            if not isinstance(leaf, jax.Array):
                raise TypeError(
                    f"map_reduce(fn): fn returned a non-array leaf at "
                    f"result{jax.tree_util.keystr(path)}: expected a JAX array, got "
                    f"{type(leaf).__name__}: {leaf!r}. Return jnp arrays (jnp.asarray(value))."
                )
        return result


def _check_server(server: PyTree) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(server)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise TypeError(
                f"map_reduce(server): server{jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r}); every server leaf is broadcast to the "
                "clients, so it must be a torch tensor (or a number). Give fn other settings "
                "by closing over them (functools.partial(fn, ...) or a lambda), not in server."
            )


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
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(
                f"map_reduce(clients): {name} is a {type(leaf).__name__} ({leaf!r}); every "
                "client leaf must be a torch tensor with the clients axis first (shape "
                "[n_clients, ...]). Give fn other settings by closing over them instead."
            )
        shape = leaf.shape
        if len(shape) == 0:
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
    (n,) = sizes
    if n == 0:
        raise ValueError(
            f"map_reduce(clients): the clients axis is empty ({', '.join(sizes[0][:3])}): "
            "there are no clients to map over, and a mean over none is undefined. Pass at least "
            "one client, or skip the round when the sampled cohort is empty."
        )
    return n


def _check_weights(weights: PyTree, n: int) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != n:
            raise ValueError(
                f"map_reduce(weights): weights{jax.tree_util.keystr(path)} has shape {shape}; "
                f"expected one weight per client, shape ({n},) (or [{n}, ...] shaped like fn's "
                "output)."
            )
