"""The types bridge_mr's signatures share, defined once for the whole package.

Importable without jax or torch (the standard library only), like `jax.typing`, so user code
can annotate with them too:

    from bridge_mr.typing import ClientFn, PyTree

    def local_loss(params: PyTree, batch: PyTree) -> PyTree: ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh

__all__ = ["AnyMesh", "AutoOrStrategy", "ClientFn", "PyTree", "Reduction", "Strategy"]

#: A pytree (nested dicts, lists, tuples, dataclasses registered with JAX) of arrays or
#: tensors and static values.
PyTree: TypeAlias = Any

#: How a round combines its clients' results: "mean", "sum" or "weighted_mean"
#: (sum(x * w) / sum(w)).
Reduction: TypeAlias = Literal["mean", "sum", "weighted_mean"]

#: How a round runs its clients: all at once ("vmap"), one at a time in an XLA loop
#: ("per_client"), `chunk_size` at a time ("chunks"), or `chunk_size` at a time packed into
#: their channels ("packed"). `bridge_mr.jax_core.map_reduce` takes these; each is what
#: `strategy="auto"` may pick ("packed" on a TPU only).
Strategy: TypeAlias = Literal["vmap", "per_client", "chunks", "packed"]

#: What the torch `map_reduce` and the algorithms take: a `Strategy`, or "auto" (decided once
#: per signature).
AutoOrStrategy: TypeAlias = Literal["auto", "vmap", "per_client", "chunks", "packed"]

#: A device mesh: concrete (`jax.sharding.Mesh`) or abstract (for tracing only).
AnyMesh: TypeAlias = "Mesh | AbstractMesh"


class ClientFn(Protocol):
    """A client function: (the server value, one client's slice) -> a pytree of arrays."""

    def __call__(self, server: PyTree, client: PyTree, /) -> PyTree: ...
