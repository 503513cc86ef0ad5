"""`map_reduce` across processes: each rank passes its own clients, one program runs over all.

The ranks agree on their client counts and on the call (`distributed.agree`), pad their rows to
a common slot, and run the round on global arrays laid out by the agreed `distributed.Layout`,
padding rows masked out; `strategy="auto"` measures alike on every rank.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import auto, distributed, jax_core
from bridge_mr.typing import AutoOrStrategy, ClientFn, PyTree, Reduction, Strategy

from . import _weights
from ._function import TorchFunction
from ._round import PROCESS_ARG_NAMES, auto_option, map_reduce_jax, trace_client


def map_reduce_processes_jax(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    layout: distributed.Layout,
    strategy: Strategy = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """The round over every rank's clients, on global arrays laid out by `layout`.

    Padding rows (after a rank's own clients) are copies of its last client, so `fn` stays
    finite there; their results are masked to zero (and their weights are zero). Server leaves
    of one float dtype travel as one vector, and so do such results (unless the weights have a
    shape per result): the program then all-reduces one array, not one per leaf (each
    cross-process collective costs milliseconds).
    """
    server_leaves = jax.tree.leaves(server)
    if len(server_leaves) > 1 and _one_float_dtype(server_leaves):
        flat, unravel = jax.flatten_util.ravel_pytree(server)

        def on_flat(flat: jax.Array, client: PyTree, fn: ClientFn = fn) -> PyTree:
            return fn(unravel(flat), client)

        fn, server = on_flat, flat
    one_client = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    shapes = jax.eval_shape(fn, server, one_client)
    results = jax.tree.leaves(shapes)
    unravel_results = None
    per_client_weights = weights is None or (
        len(jax.tree.leaves(weights)) == 1 and jax.tree.leaves(weights)[0].ndim == 1
    )
    if len(results) > 1 and per_client_weights and _one_float_dtype(results):
        zeros = jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), shapes)
        unravel_results = jax.flatten_util.ravel_pytree(zeros)[1]

        def packed(server: PyTree, client: PyTree, fn: ClientFn = fn) -> jax.Array:
            return jax.flatten_util.ravel_pytree(fn(server, client))[0]

        fn = packed

    def run(fn: ClientFn, clients: PyTree, reduce: Reduction) -> PyTree:
        mesh = layout.mesh
        return map_reduce_jax(
            fn, server, clients, weights, reduce, placement, mesh, strategy, chunk_size
        )

    out = _masked_round(run, fn, clients, reduce, layout)
    return out if unravel_results is None else unravel_results(out)


def _one_float_dtype(leaves: Sequence[Any]) -> bool:
    dtypes = {np.dtype(leaf.dtype) for leaf in leaves}
    return len(dtypes) == 1 and jnp.issubdtype(next(iter(dtypes)), jnp.inexact)


def _masked_round(
    run: Callable[[ClientFn, PyTree, Reduction], PyTree],
    fn: ClientFn,
    clients: PyTree,
    reduce: Reduction,
    layout: distributed.Layout,
) -> PyTree:
    """`run(fn, clients, reduce)` with padding rows masked out (see `map_reduce_processes_jax`)."""
    if not layout.padded:
        return run(fn, clients, reduce)

    def masked(server: PyTree, client: tuple[jax.Array, PyTree]) -> PyTree:
        real, data = client
        return jax.tree.map(lambda o: jnp.where(real, o, jnp.zeros_like(o)), fn(server, data))

    inner: Reduction = "sum" if reduce == "mean" else reduce
    real = jnp.asarray(layout.mask())
    out = run(masked, (real, clients), inner)
    if reduce != "mean":
        return out
    default_float = jnp.result_type(float)
    return jax.tree.map(
        lambda total: (
            total / layout.total
            if jnp.issubdtype(total.dtype, jnp.inexact)
            else total.astype(default_float) / layout.total
        ),
        out,
    )


MAP_REDUCE_PROCESSES = TorchFunction(
    map_reduce_processes_jax, name="map_reduce", arg_names=PROCESS_ARG_NAMES
)
# `auto` across processes: see `_map_reduce._ONE_PROCESS`. Timings and budgets are agreed.
_PROCESSES = auto.RoundKind(
    MAP_REDUCE_PROCESSES,
    map_reduce_processes_jax,
    trace_client,
    distributed.agree_seconds,
    distributed.agree_minimum,
    across_processes=True,
)


def holds_tensors(tree: PyTree) -> bool:
    """Whether any leaf of `tree` is a torch tensor."""
    return any(isinstance(leaf, torch.Tensor) for leaf in jax.tree.leaves(tree))


def across_processes(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    reduce: Reduction,
    weights: PyTree | None,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
    check_weights: bool,
    strategy: AutoOrStrategy,
    chunk_size: int | None,
    memory_budget_bytes: int | None,
) -> PyTree:
    """`map_reduce` over the union of every rank's clients (this rank passes its own).

    Arguments as for `map_reduce`, all positional; `strategy` and `chunk_size` already checked.

    Returns:
      The round's result, the same on every rank.

    Raises:
      ValueError: a `mesh` (the layout is every process's devices), client tensors that
        disagree on this rank's count, bad weights, or ranks that disagree on the call.
      TypeError: a client leaf that is not a torch tensor.
    """
    if mesh is not None:
        raise ValueError(
            "map_reduce(mesh=...): across processes, map_reduce shards the clients over every "
            "process's devices itself (one mesh of all of jax.devices()); got a mesh of "
            f"{getattr(mesh, 'size', '?')} devices. Drop mesh=."
        )
    count = _local_count(clients)
    if weights is not None and check_weights and reduce == "weighted_mean":
        check_after = _weights.check_weights(weights)
        if check_after is not None:
            check_after()
    process = distributed.current()
    checking = process is not None and process.check_replicas
    server_leaves = jax.tree_util.tree_flatten_with_path(server)[0]
    server_tensors = [(p, t) for p, t in server_leaves if isinstance(t, torch.Tensor)]
    counts = distributed.agree(
        count,
        _process_signature(fn, server, clients, weights, reduce, placement, strategy, chunk_size),
        [_tensor_hash(t) for _, t in server_tensors] if checking else None,
        [f"server{jax.tree_util.keystr(p)}" for p, _ in server_tensors],
        where="map_reduce",
    )
    layout = distributed.Layout(
        counts, distributed.slot_for(counts), jax.process_index(), placement
    )
    clients = _pad_rows(clients, count, layout.slot, repeat_last=True)
    if weights is not None:
        weights = _pad_rows(weights, count, layout.slot, repeat_last=False)
    args = (fn, server, clients, weights, reduce, placement, layout)
    if strategy == "auto":
        return MAP_REDUCE_PROCESSES(*args, *auto_option(args, memory_budget_bytes, _PROCESSES))
    return MAP_REDUCE_PROCESSES(*args, strategy, chunk_size)


def _local_count(clients: PyTree) -> int:
    """This rank's client count: the leading dimension every client tensor shares (maybe 0:
    `distributed.agree` then refuses it on every rank together)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(clients)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"map_reduce: across processes, clients{jax.tree_util.keystr(path)} must be a "
                f"torch tensor (this rank's clients along its first axis); got "
                f"{type(leaf).__name__}. Pass torch tensors, or global JAX arrays (then pass "
                "JAX arrays only)."
            )
    return int(jax_core.client_count(clients, array_types=(torch.Tensor,), empty_ok=True))


def _pad_rows(tree: PyTree, count: int, slot: int, *, repeat_last: bool) -> PyTree:
    """Each tensor with rows up to `slot`: copies of its last row (clients) or zeros (weights).

    Differentiable torch ops, so the gradients of the padded tensors reach the given ones.
    """
    if slot == count:
        return tree

    def pad(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
            return leaf
        extra = (slot - count, *leaf.shape[1:])
        rows = leaf[-1:].expand(extra) if repeat_last else leaf.new_zeros(extra)
        return torch.cat([leaf, rows])

    return jax.tree.map(pad, tree)


def _process_signature(
    fn: Any,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: str,
    placement: str,
    strategy: str,
    chunk_size: int | None,
) -> str:
    """The call in words, the same on every rank that runs the same program."""

    def avals(tree: PyTree, *, rows: bool) -> str:
        parts = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                shape = list(leaf.shape[1:] if rows else leaf.shape)
                grad = "*" if leaf.requires_grad and torch.is_grad_enabled() else ""
                dtype = str(leaf.dtype).removeprefix("torch.")
                parts.append(f"{jax.tree_util.keystr(path)}:{dtype}{shape}{grad}")
            else:
                parts.append(f"{jax.tree_util.keystr(path)}={leaf!r}")
        return "{" + ", ".join(parts) + "}"

    code = getattr(fn, "__code__", None)
    where = f" at {os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else ""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (
        f"{name}{where} reduce={reduce} strategy={strategy} chunk_size={chunk_size} "
        f"placement={placement} server={avals(server, rows=False)} "
        f"clients={avals(clients, rows=True)} weights={avals(weights, rows=True)}"
    )


def _tensor_hash(tensor: torch.Tensor) -> bytes:
    """A hash of the tensor's bytes (for the replica check)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).digest()
