"""What runs on a Beam worker: exported segments and the float64 accumulators.

Imports only jax and numpy (and the plain-data plan, the standard-library cache registry
and its `Bounded`): a worker never loads torch nor the tracing side of bridge_mr. Segments are
deserialized once per process, and the `SEGMENTS` most recently used stay compiled.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from bridge_mr._caches import Bounded, register

from ._plan import Aggregation, Plan, Segment

#: How many deserialized segments a process keeps (a program of K rounds has 2K + 1).
SEGMENTS = 64

_CACHE: Bounded[bytes, Any] = register("beam worker segments", Bounded(SEGMENTS))
_LOCK = threading.Lock()  # One deserialization per segment, even when bundles run in threads.

#: An accumulator: [client count, one running sum per aggregation (None before the first add)].
Accumulator = list[Any]


def _callable(segment: Segment) -> Any:
    with _LOCK:
        call = _CACHE.use(segment.serialized)
        if call is None:
            exported = jax.export.deserialize(bytearray(segment.serialized))
            call = jax.jit(exported.call)
            _CACHE.put(segment.serialized, call)
        return call


def _carrier(count: int) -> np.ndarray[Any, Any]:
    return np.zeros((count, 0), np.float32)


def run_server(
    segment: Segment, env: Sequence[Any], reduced: Sequence[Any], count: int
) -> list[np.ndarray[Any, Any]]:
    """Runs a server segment on the server values `env` and the previous round's aggregations."""
    outs = _callable(segment)(_carrier(count), *env, *reduced)
    return [np.asarray(x) for x in outs]


def run_client(
    segment: Segment, carry: Sequence[Any], env: Sequence[Any]
) -> tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]]]:
    """Runs a client segment on a bundle of clients (every carry value: clients first).

    Returns:
        (the bundle's carry for later rounds, its contributions to this round's aggregations).
    """
    count = int(np.shape(carry[0])[0]) if carry else 0
    outs = [np.asarray(x) for x in _callable(segment)(_carrier(count), *carry, *env)]
    return outs[: segment.num_client_out], outs[segment.num_client_out :]


def _accumulation_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    if np.issubdtype(dtype, np.complexfloating):
        return np.dtype(np.complex128)
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        return np.dtype(np.int64)
    return np.dtype(np.float64)


def create_accumulator(num_aggregations: int) -> Accumulator:
    """An empty accumulator for `num_aggregations` sums."""
    return [0, *([None] * num_aggregations)]


def add_contributions(acc: Accumulator, contributions: Sequence[Any]) -> Accumulator:
    """Adds a bundle's contributions (each with the bundle's clients first) to `acc`."""
    count = None
    for i, x in enumerate(contributions):
        x = np.asarray(x)
        count = x.shape[0] if count is None else count
        total = np.sum(x, axis=0, dtype=_accumulation_dtype(x.dtype))
        acc[i + 1] = total if acc[i + 1] is None else acc[i + 1] + total
    acc[0] += int(count or 0)
    return acc


def merge_accumulators(accumulators: Sequence[Accumulator]) -> Accumulator:
    """Merges partial accumulators (any order, any grouping: the sums commute)."""
    merged = create_accumulator(len(accumulators[0]) - 1) if accumulators else [0]
    for acc in accumulators:
        merged[0] += acc[0]
        for i, x in enumerate(acc[1:], start=1):
            if x is not None:
                merged[i] = x if merged[i] is None else merged[i] + x
    return merged


def extract(
    acc: Accumulator, aggregations: Sequence[Aggregation], expected: int | None
) -> tuple[int, list[np.ndarray[Any, Any]]]:
    """The aggregations' results (means divided by the count), in their program dtypes.

    Raises:
        ValueError: No client contributed, or the count differs from `expected`.
    """
    count = acc[0]
    if count == 0:
        raise ValueError(
            "bridge_mr.beam: no client records reached the aggregation; the program needs at "
            "least one client."
        )
    if expected is not None and count != expected:
        raise ValueError(
            f"bridge_mr.beam: the aggregation counted {count} clients, expected {expected} "
            "(records were lost or duplicated between rounds)."
        )
    results = []
    for aggregation, total in zip(aggregations, acc[1:], strict=True):
        value = total / count if aggregation.kind == "mean" else total
        results.append(np.asarray(value).astype(aggregation.dtype))
    return count, results


def stack_records(
    records: Sequence[Any],
    treedef: Any,
    avals: Sequence[tuple[tuple[int, ...], np.dtype[Any]]],
    first_index: int | None,
) -> list[np.ndarray[Any, Any]]:
    """Checks client records against the expected types and stacks them leaf by leaf.

    Args:
        records: The records (each a tuple of the placed arguments' per-client values).
        treedef: The tree structure of one record.
        avals: Each leaf's expected (shape, dtype).
        first_index: The index of `records[0]` among all records, for errors (None: unknown).

    Raises:
        ValueError: A record has another structure, or a leaf another shape or dtype.
    """
    columns: list[list[Any]] = [[] for _ in avals]
    for offset, record in enumerate(records):
        name = "a client record" if first_index is None else f"client record {first_index + offset}"
        leaves, tree = jax.tree.flatten(record)
        if tree != treedef:
            raise ValueError(
                f"bridge_mr.beam: {name} has structure {tree}; expected {treedef} (a tuple of "
                "the program's placed arguments, for one client)."
            )
        for i, (leaf, (shape, dtype)) in enumerate(zip(leaves, avals, strict=True)):
            array = np.asarray(leaf)
            given = jax.dtypes.canonicalize_dtype(array.dtype)
            if array.shape != shape or given != dtype:
                raise ValueError(
                    f"bridge_mr.beam: {name}, leaf {i}: expected {dtype}{list(shape)}, got "
                    f"{array.dtype}{list(array.shape)}. Every client's record must have the "
                    "same types as the first (or as record_spec)."
                )
            columns[i].append(array.astype(dtype, copy=False))
    return [np.stack(column) for column in columns]


def interpret(
    plan: Plan, server_leaves: Sequence[Any], stacked: Sequence[Any], bundle_sizes: Sequence[int]
) -> list[np.ndarray[Any, Any]]:
    """Runs `plan` in this process as the pipeline would: bundles, accumulators, merges.

    Args:
        plan: The split program.
        server_leaves: The server arguments' leaves.
        stacked: The client records' leaves, stacked (clients first).
        bundle_sizes: How the clients are cut into bundles (they sum to the client count).

    Returns:
        The result leaves, as `run` returns them before unflattening.
    """
    count = int(sum(bundle_sizes))
    starts = np.cumsum([0, *bundle_sizes])
    bundles = [[x[a:b] for x in stacked] for a, b in itertools.pairwise(starts)]
    env = run_server(plan.server_segment(0), [*server_leaves, *plan.consts], [], count)
    for k in range(plan.num_rounds):
        outs = [run_client(plan.client_segment(k), bundle, env) for bundle in bundles]
        partials = [
            add_contributions(create_accumulator(len(plan.aggregations[k])), c) for _, c in outs
        ]
        # Merged in reverse, as one tree: the order must not matter.
        acc = merge_accumulators(partials[::-1])
        count, reduced = extract(acc, plan.aggregations[k], count)
        bundles = [carry for carry, _ in outs]
        env = run_server(plan.server_segment(k + 1), env, reduced, count)
    return results(plan, env)


def results(plan: Plan, env: Sequence[Any]) -> list[np.ndarray[Any, Any]]:
    """The program's result leaves from the last server segment's values."""
    return [np.asarray(env[i]) if kind == "env" else np.asarray(i) for kind, i in plan.outputs]
