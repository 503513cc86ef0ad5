"""The torch frontend's compile caches: how often they traced, and clearing them."""

from __future__ import annotations

import jax

from bridge_mr import _caches

from . import _map_reduce, _ops


def trace_counts() -> dict[str, int]:
    """How many times each torch-level entry point has traced a JAX program so far.

    A training loop whose counts stop growing after its first steps does not retrace. The
    counts include traces of the programs derived from a call (its backward).

    Returns:
      A dict from entry point name ("map_reduce", "broadcast", "map_fn", "reduce_sum",
      "reduce_mean", "reduce_weighted_mean") to its trace count. For a function made with
      `torch_function`, read its own `trace_count`.

    Example:
      >>> step = lambda: bridge_mr.map_reduce(jax_loss, params, batch, strategy="vmap").backward()
      >>> step()  # traces (forward and backward) on the first call of this signature
      >>> before = bridge_mr.trace_counts()["map_reduce"]
      >>> for _ in range(3):
      ...     step()
      >>> bridge_mr.trace_counts()["map_reduce"] == before  # the same signature: no new trace
      True
      >>> sorted(bridge_mr.trace_counts())
      ['broadcast', 'map_fn', 'map_reduce', 'reduce_mean', 'reduce_sum', 'reduce_weighted_mean']
    """
    functions = (_map_reduce.MAP_REDUCE, *_ops.OPERATIONS)
    return {repr(fn): fn.trace_count for fn in functions}


def clear_caches() -> None:
    """Drops every traced and compiled program the torch frontend holds, and JAX's caches.

    Afterwards bridge_mr keeps no user function, closure or captured array alive: every cache
    a loaded bridge_mr module registered (`bridge_mr._caches`) is emptied -- each torch
    function's entries (`TorchFunction.clear_cache`), the choices of `strategy="auto"`, the
    custom op's traced calls (compiled graphs rebuild theirs by name), the torch-xla
    embeddings -- and then `jax.clear_caches()` runs. Calls trace again; trace counts keep
    counting.

    Example:
      >>> bridge_mr.map_reduce(client_loss, params, batch)
      >>> bridge_mr.clear_caches()  # client_loss and what it closes over can now be freed
    """
    _caches.clear_all()
    jax.clear_caches()
