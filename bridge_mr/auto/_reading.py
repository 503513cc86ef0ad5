"""What `auto` reads from a call without running it: its shapes, one client's slice, and each
candidate's program as the cost model reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import distributed, jax_core
from bridge_mr.dlpack import tensor_avals
from bridge_mr.typing import PyTree

from ._cost import Cost, cost
from ._report import Option


def specs(args: tuple[Any, ...], across_processes: bool) -> tuple[PyTree, PyTree, PyTree]:
    """The round's (server, clients, weights) as `jax.ShapeDtypeStruct`s (global and sharded
    over the layout across processes); other leaves as they are.

    Raises:
      TypeError: a tensor JAX cannot take (the call raises it again, naming the leaf).
    """
    _, server, clients, weights, _, placement, mesh = args
    layout = mesh if across_processes and isinstance(mesh, distributed.Layout) else None

    def as_spec(path: Any, leaf: Any, arg: str, per_rank: bool) -> Any:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)  # An input already on device.
        if not isinstance(leaf, torch.Tensor):
            return leaf
        where = f"map_reduce: argument {arg}{jax.tree_util.keystr(path)}"
        ((shape, dtype),) = tensor_avals([leaf], [where])
        if layout is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        spec = jax.sharding.PartitionSpec(placement) if per_rank else jax.sharding.PartitionSpec()
        return jax.ShapeDtypeStruct(
            layout.global_shape(shape) if per_rank else shape,
            dtype,
            sharding=jax.sharding.NamedSharding(layout.mesh, spec),
        )

    server_spec, clients_spec, weights_spec = (
        jax.tree_util.tree_map_with_path(
            lambda path, leaf, arg=arg: as_spec(path, leaf, arg, arg != "server"), tree
        )
        for arg, tree in (("server", server), ("clients", clients), ("weights", weights))
    )
    return server_spec, clients_spec, weights_spec


def one_client(specs: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree]:
    """The server value and one client's slice, as the round hands them to the client function."""
    server, clients, _ = specs

    def unsharded(leaf: Any, rows: bool) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape[1:] if rows else leaf.shape, leaf.dtype)
        return leaf[0] if rows else jnp.asarray(leaf)

    return (
        jax.tree.map(lambda leaf: unsharded(leaf, False), server),
        jax.tree.map(lambda leaf: unsharded(leaf, True), clients),
    )


def round_cost(
    program: Callable[..., PyTree],
    args: tuple[Any, ...],
    specs: tuple[PyTree, ...],
    option: Option,
    grads: bool,
) -> Cost | None:
    """The cost model's reading of a candidate's program (None where it does not trace).

    Only the forward program is traced (differentiating it too took 5x longer on an LSTM
    round); with gradients the estimate scales it: forward and backward are about 3x the
    forward's operations (4x for per_client, whose checkpointed loop recomputes each client's
    forward), vmap keeps what its forward computes for the backward pass (an upper bound), and
    the checkpointed loops of per_client and chunks hold about one step's forward again.
    """
    fn, _, _, _, reduce, placement, mesh = args

    def forward(server: PyTree, clients: PyTree, weights: PyTree) -> PyTree:
        return program(fn, server, clients, weights, reduce, placement, mesh, *option)

    try:
        found = cost(jax.make_jaxpr(forward)(*specs))
    except Exception:  # Bad arguments: the call raises again, with the bridge's message.
        return None
    if not grads:
        return found
    looped = option[0] != "vmap"
    return dataclasses.replace(
        found,
        flops=found.flops * (4 if option[0] == "per_client" else 3),
        peak_bytes=found.peak_bytes + (found.peak_bytes if looped else found.computed_bytes),
    )


def client_count(clients: PyTree) -> int:
    """The clients' leading dimension (0 when there is none: the vmap call then says why)."""
    try:
        return int(
            jax_core.client_count(clients, array_types=(torch.Tensor, jax.Array, np.ndarray))
        )
    except (TypeError, ValueError):
        return 0


def explicit_placement(placement: str, mesh: Mesh | AbstractMesh | None) -> bool:
    """Whether the call's mesh has `placement` as an Explicit axis."""
    mesh = jax_core.ambient_mesh() if mesh is None else mesh
    if mesh is None or placement not in mesh.axis_names:
        return False
    return mesh.axis_types[mesh.axis_names.index(placement)] == jax.sharding.AxisType.Explicit
