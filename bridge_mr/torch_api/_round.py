"""A `map_reduce` round: what it takes (the client function, reductions, strategies, argument
names) and its JAX program, which the torch functions of `_map_reduce` and `_processes` run."""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias

from jax.sharding import AbstractMesh, Mesh

from bridge_mr import jax_core

PyTree: TypeAlias = Any
Reduction: TypeAlias = Literal["mean", "sum", "weighted_mean"]
Strategy: TypeAlias = Literal["auto", "vmap", "per_client", "chunks"]
#: The strategies a round runs with (those `auto` measures).
Measured: TypeAlias = Literal["vmap", "per_client", "chunks"]
#: The strategies the torch `map_reduce` offers: the JAX round's and "auto".
STRATEGIES: tuple[str, ...] = ("auto", *jax_core.STRATEGIES)

#: The positional arguments of the round's torch functions, as their errors name them.
ARG_NAMES: tuple[str, ...] = (
    "fn",
    "server",
    "clients",
    "weights",
    "reduce",
    "placement",
    "mesh",
    "strategy",
    "chunk_size",
)
#: The same across processes, where the layout takes the mesh's place.
PROCESS_ARG_NAMES: tuple[str, ...] = (*ARG_NAMES[:6], "layout", *ARG_NAMES[7:])


class ClientFn(Protocol):
    """A JAX function of (server value, one client's slice) returning a pytree of arrays."""

    def __call__(self, server: PyTree, client: PyTree, /) -> PyTree: ...


def map_reduce_jax(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
    strategy: Measured = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """The JAX program behind `map_reduce` (arguments as there, all positional).

    Returns:
      `bridge_mr.jax_core.map_reduce` of the arguments.
    """
    return jax_core.map_reduce(
        fn,
        server,
        clients,
        reduce=reduce,
        weights=weights,
        placement=placement,
        mesh=mesh,
        strategy=strategy,
        chunk_size=chunk_size,
    )
