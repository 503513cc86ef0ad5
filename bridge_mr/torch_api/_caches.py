"""The torch frontend's compile caches: how often they traced, and clearing them."""

from __future__ import annotations

import jax

from bridge_mr import runners

from . import _custom_op, _function, _map_reduce, _ops, _static


def trace_counts() -> dict[str, int]:
    """How many times each torch-level entry point has traced a JAX program so far.

    A training loop whose counts stop growing after its first steps does not retrace. The
    counts include traces of the programs derived from a call (its backward).

    Returns:
      A dict from entry point name ("map_reduce", "broadcast", "map_fn", "reduce_sum",
      "reduce_mean", "reduce_weighted_mean") to its trace count. For a function made with
      `torch_function`, read its own `trace_count`.

    Example:
      >>> before = bridge_mr.trace_counts()["map_reduce"]
      >>> for batch in batches:
      ...     bridge_mr.map_reduce(client_loss, params, batch).backward()
      >>> assert bridge_mr.trace_counts()["map_reduce"] - before <= 2  # forward + backward
    """
    functions = (_map_reduce.MAP_REDUCE, *_ops.OPERATIONS)
    return {repr(fn): fn.trace_count for fn in functions}


def clear_caches() -> None:
    """Drops every traced and compiled program the torch frontend holds, and JAX's caches.

    Afterwards bridge_mr keeps no user function, closure or captured array alive: each torch
    function's entries (`TorchFunction.clear_cache`), the custom op's traced calls (compiled
    graphs rebuild theirs by name), the torch-xla embeddings, and `jax.clear_caches()`. Calls
    trace again; trace counts keep counting.

    Example:
      >>> bridge_mr.map_reduce(client_loss, params, batch)
      >>> bridge_mr.clear_caches()  # client_loss and what it closes over can now be freed
    """
    _function.clear_all()
    _static.clear()
    _custom_op.clear()
    runners.clear_caches()
    jax.clear_caches()
