"""The placement operations on torch tensors: broadcast, map_fn and the reductions.

Each accepts pytrees of torch tensors, runs the JAX primitive under the active `program` as one
compiled, differentiable call, and returns torch tensors. Given no torch tensors, each is the
JAX-level function itself, so the same names serve JAX code.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import torch

from bridge_mr import distributed, jax_core
from bridge_mr.typing import AnyMesh, PyTree

from ._function import TorchFunction

_BROADCAST = TorchFunction(
    jax_core.broadcast, passthrough_jax=True, name="broadcast", arg_names=("x",)
)
_MAP_FN = TorchFunction(
    jax_core.map_fn, passthrough_jax=True, name="map_fn", arg_names=("fn", "arg")
)
_REDUCE_SUM = TorchFunction(
    jax_core.reduce_sum, passthrough_jax=True, name="reduce_sum", arg_names=("x",)
)
_REDUCE_MEAN = TorchFunction(
    jax_core.reduce_mean, passthrough_jax=True, name="reduce_mean", arg_names=("x",)
)
_REDUCE_WEIGHTED_MEAN = TorchFunction(
    jax_core.reduce_weighted_mean,
    passthrough_jax=True,
    name="reduce_weighted_mean",
    arg_names=("x", "w"),
)


#: The torch functions of the five operations (their trace counts are public: `trace_counts`).
OPERATIONS = (_BROADCAST, _MAP_FN, _REDUCE_SUM, _REDUCE_MEAN, _REDUCE_WEIGHTED_MEAN)


def broadcast(x: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Places every leaf of `x` at the active placement: a new leading axis of its size.

    Torch tensors in, torch tensors out (differentiable). `bridge_mr.broadcast` documents the
    arguments, result and errors; this is what it calls once torch is imported.
    """
    return _BROADCAST(x, mesh=mesh)


def map_fn(fn: Callable[..., PyTree], arg: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Applies the JAX function `fn` to each slice of `arg` along the placement axis.

    A tuple `arg` is unpacked into positional arguments. Torch tensors in, torch tensors out
    (differentiable). `bridge_mr.map_fn` documents the arguments, result and errors; this is
    what it calls once torch is imported.
    """
    return _MAP_FN(fn, arg, mesh=mesh)


def _this_process_only(name: str, tree: PyTree) -> None:
    """Refuses a torch-level reduction across processes: it would reduce this rank's rows only."""
    if distributed.multi_process() and any(
        isinstance(leaf, torch.Tensor) for leaf in jax.tree.leaves(tree)
    ):
        raise NotImplementedError(
            f"bridge_mr.{name} on torch tensors across processes would reduce this rank's "
            "clients only, not every rank's. Use bridge_mr.map_reduce(fn, server, "
            "my_clients, reduce=...), which maps over every rank's clients and returns the "
            "global reduction on every rank."
        )


def reduce_sum(x: PyTree) -> PyTree:
    """Sums every leaf of the placed value `x` over its leading placement axis.

    The torch-level `bridge_mr.reduce_sum` (documented there).
    """
    _this_process_only("reduce_sum", x)
    return _REDUCE_SUM(x)


def reduce_mean(x: PyTree) -> PyTree:
    """Averages every leaf of the placed value `x` over its leading placement axis.

    The torch-level `bridge_mr.reduce_mean` (documented there).
    """
    _this_process_only("reduce_mean", x)
    return _REDUCE_MEAN(x)


def reduce_weighted_mean(x: PyTree, w: PyTree) -> PyTree:
    """The weighted mean sum(x·w) / sum(w) over the placement axis, leaf by leaf.

    `w` is one placed array (shape [n]) used for every leaf, or a pytree shaped like `x`. The
    torch-level `bridge_mr.reduce_weighted_mean` (documented there).
    """
    _this_process_only("reduce_weighted_mean", (x, w))
    return _REDUCE_WEIGHTED_MEAN(x, w)
