"""bridge_mr: DrJAX-style MapReduce primitives as JAX primitives, callable from PyTorch.

The five MapReduce names (`broadcast`, `map_fn`, `reduce_sum`, `reduce_mean`,
`reduce_weighted_mean`) accept torch tensors (differentiable, through the bridge) and JAX values.
`bridge_mr.jax_core` is the plain-JAX layer; `bridge_mr.dlpack` the tensor exchange.

Importing bridge_mr does not import torch: plain-JAX programs (export tools, Beam or
`jax.distributed` workers) never pay for it. The torch-only names (`map_reduce`,
`map_reduce_choices`, `torch_function`, `TorchFunction`, `RetraceWarning`, `trace_counts`,
`from_torch`, `client_keys`) and the `dlpack`, `torch_api`, `torch_fn`, `auto` (how
`strategy="auto"` chooses, its public `settings`), `algorithms` (FedAvg, FedOpt, DiLoCo,
DP-FedAvg, ...) and `data` (federated datasets, partitions, per-round batches) subpackages load
torch on first access (torchax,
behind `from_torch`, on a converted function's first call). The five MapReduce names run the
JAX layer directly until torch is imported, since no torch tensor can exist before; from then on
they run `bridge_mr.torch_api`, which accepts torch tensors and JAX values alike.
`bridge_mr.typing` holds the shared types (`PyTree`, `ClientFn`, `Strategy`, ...).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bridge_mr.typing import AnyMesh, PyTree

from . import jax_core as jax_core
from ._flags import recommended_xla_flags as recommended_xla_flags
from .jax_core import Placement as Placement
from .jax_core import clear_caches as clear_caches
from .jax_core import current_placement as current_placement
from .jax_core import program as program

if TYPE_CHECKING:
    from . import algorithms as algorithms
    from . import auto as auto
    from . import beam as beam
    from . import data as data
    from . import distributed as distributed
    from . import dlpack as dlpack
    from . import torch_api as torch_api
    from . import torch_fn as torch_fn
    from .torch_api import RetraceWarning as RetraceWarning
    from .torch_api import TorchFunction as TorchFunction
    from .torch_api import map_reduce as map_reduce
    from .torch_api import map_reduce_choices as map_reduce_choices
    from .torch_api import torch_function as torch_function
    from .torch_api import trace_counts as trace_counts
    from .torch_fn import client_keys as client_keys
    from .torch_fn import from_torch as from_torch


__all__ = [
    "Placement",
    "RetraceWarning",
    "TorchFunction",
    "broadcast",
    "clear_caches",
    "client_keys",
    "current_placement",
    "dlpack",
    "from_torch",
    "jax_core",
    "map_fn",
    "map_reduce",
    "map_reduce_choices",
    "program",
    "recommended_xla_flags",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
    "torch_function",
    "trace_counts",
]

_TORCH_API = f"{__name__}.torch_api"
_LAZY_TORCH_API_NAMES = frozenset(
    {
        "RetraceWarning",
        "TorchFunction",
        "map_reduce",
        "map_reduce_choices",
        "torch_function",
        "trace_counts",
    }
)
_TORCH_FN = f"{__name__}.torch_fn"
_LAZY_TORCH_FN_NAMES = frozenset({"client_keys", "from_torch"})
_torch_api: ModuleType | None = None  # bridge_mr.torch_api once fully imported.


def _import(module: str, what: str) -> ModuleType:
    """Imports `module`; a missing torch becomes an error that says how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"bridge_mr.{what} needs PyTorch, which is not installed in this environment. "
            'Install it with `pip install "bridge_mr[torch]"` (or any torch>=2.9, CPU or CUDA '
            "build, e.g. `pip install torch==2.13.0`). bridge_mr.jax_core and bridge_mr.beam "
            "work without it.",
            name="torch",
        ) from error


def _load_torch_api(what: str = "torch_api") -> ModuleType:
    """Imports bridge_mr.torch_api (and torch); returns only once the import is complete."""
    global _torch_api
    _torch_api = _import(_TORCH_API, what)
    return _torch_api


def __getattr__(name: str) -> Any:
    """Loads the torch-dependent names on first access (they import torch)."""
    if name == "torch_api":
        return _load_torch_api()
    if name in ("algorithms", "auto", "beam", "data", "distributed", "dlpack", "torch_fn"):
        return _import(f"{__name__}.{name}", name)
    if name in _LAZY_TORCH_FN_NAMES:
        value = getattr(_import(_TORCH_FN, name), name)
        globals()[name] = value
        return value
    if name in _LAZY_TORCH_API_NAMES:
        value = getattr(_load_torch_api(name), name)
        globals()[name] = value  # Later lookups find it without calling __getattr__.
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the lazy ones included (listing them loads nothing)."""
    return sorted(
        {*__all__, "algorithms", "auto", "beam", "data", "distributed", "torch_api", "torch_fn"}
    )


def _frontend() -> ModuleType:
    """The module whose MapReduce functions serve the top-level names.

    `bridge_mr.torch_api` once torch is imported, else `bridge_mr.jax_core`: before torch is
    imported no torch tensor can exist, and the JAX layer is what torch_api would call anyway.
    """
    if _torch_api is not None:
        return _torch_api
    if sys.modules.get("torch") is None:  # Not imported (or blocked): no torch tensor exists.
        return jax_core
    return _load_torch_api()


def broadcast(x: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Places every leaf of `x` at the active placement: a new leading axis of its size.

    Torch tensors give torch tensors (differentiable through the bridge); JAX values give JAX
    values (see `bridge_mr.jax_core.broadcast` for the sharding rules).

    Args:
        x: A pytree of torch tensors, or of JAX arrays (or values convertible to them).
        mesh: The mesh to shard the placement axis over; None uses the mesh set with
            `jax.set_mesh` (or the legacy `with mesh:`), if any.

    Returns:
        `x` with every leaf repeated along a new leading axis of the placement's size.

    Raises:
        RuntimeError: Outside any `bridge_mr.program`.
        TypeError: A leaf is neither a tensor nor convertible to a JAX array, or `mesh` is not a
            mesh.
        ValueError: An Explicit placement axis of the mesh does not divide the placement size.

    Example:
        >>> with bridge_mr.program(placements={"clients": 8}):
        ...     placed = bridge_mr.broadcast(params)  # each leaf gains a leading axis of size 8
        >>> placed["w"].shape, placed["b"].shape
        (torch.Size([8, 3]), torch.Size([8]))
    """
    return _frontend().broadcast(x, mesh=mesh)


def map_fn(fn: Callable[..., PyTree], arg: PyTree, *, mesh: AnyMesh | None = None) -> PyTree:
    """Applies the JAX function `fn` to each slice of `arg` along the placement axis.

    A tuple `arg` is unpacked into positional arguments of `fn`. Torch tensors give torch
    tensors (differentiable through the bridge); JAX values give JAX values (see
    `bridge_mr.jax_core.map_fn`).

    Args:
        fn: A JAX function of one placement slice (several, for a tuple `arg`).
        arg: A placed pytree (every leaf's leading axis is the placement), or a tuple of them.
        mesh: As for `broadcast`.

    Returns:
        The placed pytree of `fn`'s results, stacked along a leading placement axis.

    Raises:
        RuntimeError: Outside any `bridge_mr.program`.
        TypeError: `fn` is not callable, or a leaf is not an array.
        ValueError: A leaf's leading dimension is not the placement size.

    Example:
        >>> with bridge_mr.program(placements={"clients": 8}):  # jax_loss: (params, batch) -> loss
        ...     losses = bridge_mr.map_fn(jax_loss, (bridge_mr.broadcast(params), batch))
        >>> losses  # one loss per client
        tensor([1., 1., 1., 1., 1., 1., 1., 1.], grad_fn=<...>)
    """
    return _frontend().map_fn(fn, arg, mesh=mesh)


def reduce_sum(x: PyTree) -> PyTree:
    """Sums every leaf of the placed value `x` over its leading placement axis.

    Args:
        x: A placed pytree of torch tensors or JAX arrays.

    Returns:
        The sums, leaf by leaf (same dtype; bools count in the default int dtype).

    Raises:
        RuntimeError: Outside any `bridge_mr.program`.
        ValueError: A leaf is 0-d or its leading dimension is not the placement size.

    Example:
        >>> with bridge_mr.program(placements={"clients": 8}):
        ...     examples = bridge_mr.map_fn(lambda b: jnp.sum(jnp.ones_like(b["y"])), batch)
        ...     total = bridge_mr.reduce_sum(examples)  # 4 examples on each of 8 clients
        >>> total
        tensor(32.)
    """
    return _frontend().reduce_sum(x)


def reduce_mean(x: PyTree) -> PyTree:
    """Averages every leaf of the placed value `x` over its leading placement axis.

    Args:
        x: A placed pytree of torch tensors or JAX arrays.

    Returns:
        The means, leaf by leaf (integer and bool leaves give the default float dtype).

    Raises:
        RuntimeError: Outside any `bridge_mr.program`.
        ValueError: A leaf is 0-d or its leading dimension is not the placement size.

    Example:
        >>> with bridge_mr.program(placements={"clients": 8}):
        ...     placed_args = (bridge_mr.broadcast(params), batch)
        ...     loss = bridge_mr.reduce_mean(bridge_mr.map_fn(jax_loss, placed_args))
        >>> loss
        tensor(1., grad_fn=<...>)
        >>> loss.backward()  # differentiable: the gradients reach params
        >>> params["b"].grad
        tensor(-2.)
    """
    return _frontend().reduce_mean(x)


def reduce_weighted_mean(x: PyTree, w: PyTree) -> PyTree:
    """The weighted mean sum(x·w) / sum(w) over the placement axis, leaf by leaf.

    Args:
        x: A placed pytree of torch tensors or JAX arrays.
        w: One placed weight array (shape [n], or broadcastable against each leaf's slices
            from the left) used for every leaf of `x`, or a pytree with the structure of `x`.

    Returns:
        The weighted means, leaf by leaf.

    Raises:
        RuntimeError: Outside any `bridge_mr.program`.
        ValueError: A leading dimension is not the placement size, or `w` has neither one leaf
            nor the structure of `x`.

    Example:
        >>> client_updates = torch.arange(8.0)
        >>> num_examples = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1])
        >>> with bridge_mr.program(placements={"clients": 8}):
        ...     update = bridge_mr.reduce_weighted_mean(client_updates, num_examples)
        >>> update  # (0 * 1 + 7 * 1) / 2
        tensor(3.5000)
    """
    return _frontend().reduce_weighted_mean(x, w)
