"""Introspection of the torch frontend's compile caches."""

from __future__ import annotations

from . import _map_reduce, _primitives


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
    functions = (_map_reduce.MAP_REDUCE, *_primitives.PRIMITIVES)
    return {repr(fn): fn.trace_count for fn in functions}
