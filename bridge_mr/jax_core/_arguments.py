"""`map_reduce`'s argument checks: each bad argument gets an error naming it and the fix."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType

from bridge_mr.typing import PyTree

from ._mesh import AnyMesh, axis_type, check_mesh
from ._program import Placement

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "weighted_mean")
STRATEGIES: tuple[str, ...] = ("vmap", "per_client", "chunks", "packed")
#: The strategies that take a `chunk_size`.
CHUNKED: tuple[str, ...] = ("chunks", "packed")


def check_arguments(
    fn: Any, reduce: Any, weights: Any, placement: Any, mesh: Any, strategy: Any, chunk_size: Any
) -> None:
    """Checks `map_reduce`'s arguments other than the trees.

    Raises:
      ValueError: a bad `reduce`, `strategy` or `chunk_size`, weights missing for
        "weighted_mean" or given without it.
      TypeError: `fn` not callable, `placement` not a non-empty str, `mesh` not a mesh.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(
            f"map_reduce(reduce=...): expected one of {', '.join(map(repr, REDUCTIONS))}; got "
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
    check_mesh(mesh, caller="map_reduce", placement=placement)
    check_strategy(strategy, chunk_size)


def check_strategy(
    strategy: object, chunk_size: object, strategies: tuple[str, ...] = STRATEGIES
) -> None:
    """Checks `map_reduce`'s `strategy=` and `chunk_size=` arguments.

    Args:
      strategy: the `strategy=` argument.
      chunk_size: the `chunk_size=` argument: a positive int for "chunks" and "packed", else
        None.
      strategies: the strategies the caller offers (the torch frontend adds "auto").

    Raises:
      ValueError: `strategy` is not one of `strategies`, "chunks" or "packed" without a
        positive int `chunk_size`, or a `chunk_size` with another strategy; the message names
        the argument and the fix.

    Example:
      >>> bridge_mr.jax_core.check_strategy("chunks", 32)  # Fine: returns None.
      >>> bridge_mr.jax_core.check_strategy("vmap", 32)
      Traceback (most recent call last):
      ValueError: map_reduce(chunk_size=32) is only for strategy='chunks' or 'packed' (got ...
    """
    if not isinstance(strategy, str) or strategy not in strategies:
        raise ValueError(
            f"map_reduce(strategy=...): expected one of {', '.join(map(repr, strategies))}; "
            f"got {strategy!r}."
        )
    if strategy in CHUNKED:
        _check_chunk_size(chunk_size, strategy)
    elif chunk_size is not None:
        raise ValueError(
            f"map_reduce(chunk_size={chunk_size!r}) is only for strategy='chunks' or 'packed' "
            f"(got strategy={strategy!r}). Pass strategy='chunks' with it, or drop chunk_size."
        )


def _check_chunk_size(chunk_size: Any, strategy: str) -> None:
    """Raises, naming the argument, unless `chunk_size` is a positive int."""
    try:
        size = operator.index(chunk_size)
    except TypeError:
        size = None
    if size is None or isinstance(chunk_size, bool) or size <= 0:
        raise ValueError(
            f"map_reduce(chunk_size=...): strategy={strategy!r} needs a positive int, the number "
            f"of clients run at once (e.g. chunk_size=32); got {type(chunk_size).__name__}: "
            f"{chunk_size!r}."
        )


def check_loopable(where: Placement, mesh: AnyMesh | None, strategy: str) -> None:
    """Checks that the looped `strategy` can run over `where` on `mesh`.

    Raises:
      ValueError: a symbolic client count, or an Explicit placement axis.
    """
    if jax.export.is_symbolic_dim(where.size):
        raise ValueError(
            f"map_reduce(strategy={strategy!r}) needs a concrete number of {where.name} to loop "
            f"over; got the symbolic size {where.size}. Use strategy='vmap' for a program "
            "exported for any client count."
        )
    if mesh is not None and axis_type(mesh, where.name) == AxisType.Explicit:
        raise ValueError(
            f"map_reduce(strategy={strategy!r}) does not support the Explicit mesh axis "
            f"{where.name!r} (mesh axes {dict(mesh.shape)}): a loop over {where.name} cannot "
            f"keep every value typed sharded along it. Use strategy='vmap', or make the "
            f"{where.name!r} axis Auto (axis_types=(jax.sharding.AxisType.Auto, ...))."
        )


class ArrayResults:
    """Calls the client function, insisting that it returns arrays only."""

    def __init__(self, fn: Callable[[PyTree, PyTree], PyTree]) -> None:
        self._fn = fn

    def __call__(self, server: PyTree, client: PyTree) -> PyTree:
        """`fn(server, client)`.

        Raises:
          TypeError: it holds no arrays, or a leaf that is not a JAX array.
        """
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


def check_server(server: PyTree) -> None:
    """Checks that every server leaf is an array or a number.

    Raises:
      TypeError: a leaf that is neither, named by its path.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(server)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise TypeError(
                f"map_reduce(server): server{jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r}); every server leaf is broadcast to the "
                "clients, so it must be an array (a torch tensor through bridge_mr.map_reduce) "
                "or a number. Give fn other settings by closing over them "
                "(functools.partial(fn, ...) or a lambda), not in server."
            )


def client_count(
    clients: PyTree,
    *,
    array_types: tuple[type, ...] = (jax.Array, np.ndarray),
    empty_ok: bool = False,
) -> Any:
    """The clients' common leading dimension (an int, or a symbolic dimension).

    Args:
      clients: the `clients=` argument of `map_reduce`: a pytree of arrays, clients axis first.
      array_types: what a client leaf may be (the torch frontend passes `torch.Tensor`).
      empty_ok: return 0 for an empty clients axis rather than raise (across processes, a
        rank with no clients is refused by all ranks together).

    Returns:
      The number of clients.

    Raises:
      ValueError: no leaves, a 0-d leaf, leaves that disagree on their leading dimension, or
        (unless `empty_ok`) no clients; the message names the leaves.
      TypeError: a leaf is not one of `array_types`.

    Example:
      >>> bridge_mr.jax_core.client_count({"x": jnp.ones((8, 3)), "y": jnp.ones(8)})
      8
    """
    path_leaves = jax.tree_util.tree_flatten_with_path(clients)[0]
    if not path_leaves:
        raise ValueError(
            "map_reduce(clients): expected a pytree of tensors with the clients axis first; got "
            "no tensors at all, so the number of clients is unknown."
        )
    sizes: dict[Any, list[str]] = {}
    for path, leaf in path_leaves:
        name = "clients" + jax.tree_util.keystr(path)
        if not isinstance(leaf, array_types):
            raise TypeError(
                f"map_reduce(clients): {name} is a {type(leaf).__name__} ({leaf!r}); every "
                "client leaf must be an array (a torch tensor through bridge_mr.map_reduce) "
                "with the clients axis first (shape [n_clients, ...]). Give fn other settings "
                "by closing over them instead."
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
    if not jax.export.is_symbolic_dim(n) and n == 0 and not empty_ok:
        raise ValueError(
            f"map_reduce(clients): the clients axis is empty ({', '.join(sizes[0][:3])}): "
            "there are no clients to map over, and a mean over none is undefined. Pass at least "
            "one client, or skip the round when the sampled cohort is empty."
        )
    return n


def check_weights(weights: PyTree, n: Any) -> None:
    """Checks that every weight leaf has one row per client (`n`).

    Raises:
      ValueError: a leaf of another leading dimension, named by its path.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != n:
            raise ValueError(
                f"map_reduce(weights): weights{jax.tree_util.keystr(path)} has shape {shape}; "
                f"expected one weight per client, shape ({n},) (or [{n}, ...] shaped like fn's "
                "output)."
            )
