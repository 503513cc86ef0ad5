"""Plans without Beam: `split` (cached per function and argument types), the self-test, and
`interpret`. Imports jax and numpy, never apache_beam: planning works where Beam is not installed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bridge_mr import jax_core
from bridge_mr._caches import Bounded, register
from bridge_mr._compat.jax import trace_context

from . import _worker
from ._plan import Plan
from ._split import split as split_program

#: How many plans (argument types) each program keeps; the programs themselves are held weakly.
PLANS_PER_FUNCTION = 16
_CHECK_CLIENTS = (2, 2)  # The self-test's bundles: 4 clients, two accumulators merged.

_PLANS: weakref.WeakKeyDictionary[Any, Bounded[Any, Plan]] = register(
    "beam plans", weakref.WeakKeyDictionary()
)
# Self-tested plans by id, held weakly: a plan dropped from _PLANS (and by its users) is gone
# from here before another object can take its id.
_CHECKED: weakref.WeakValueDictionary[int, Plan] = register(
    "beam self-tested plans", weakref.WeakValueDictionary()
)
_PLANS_LOCK = threading.Lock()


def _spec(leaf: Any, *, argument: str, path: Any) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    try:
        array = np.asarray(leaf)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{argument}{jax.tree_util.keystr(path)}: expected an array (numpy, JAX) or a "
            f"jax.ShapeDtypeStruct; got {type(leaf).__name__}: {leaf!r}."
        ) from err
    return jax.ShapeDtypeStruct(array.shape, jax.dtypes.canonicalize_dtype(array.dtype))


def _specs(tree: Any, argument: str) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _spec(leaf, argument=argument, path=path), tree
    )


def _plan_for(
    fn: Callable[..., Any],
    server_specs: tuple[Any, ...],
    record_spec: tuple[Any, ...],
    placement: str,
) -> Plan:
    """The plan of `fn` for these argument types (split once, like jit's trace cache)."""
    key = (
        jax.tree.structure((server_specs, record_spec)),
        tuple((s.shape, s.dtype) for s in jax.tree.leaves((server_specs, record_spec))),
        placement,
        trace_context(),
    )
    with _PLANS_LOCK:
        plans = _PLANS.get(fn)
        if plans is None:
            plans = _PLANS[fn] = Bounded(PLANS_PER_FUNCTION)
    plan = plans.use(key)
    if plan is None:
        plan = split_program(fn, server_specs, record_spec, placement=placement)
        plans.put(key, plan)
    return plan


def check_record_spec(record_spec: Any) -> tuple[Any, ...]:
    """Checks that a client record (or record_spec) is a tuple.

    Args:
        record_spec: One client's record.

    Returns:
        `record_spec` itself.

    Raises:
        TypeError: It is not a tuple.
    """
    if not isinstance(record_spec, tuple):
        raise TypeError(
            "bridge_mr.beam: a client record (and record_spec) is a tuple of the program's "
            "placed arguments for one client, in order (a 1-tuple for one placed argument); "
            f"got {type(record_spec).__name__}."
        )
    return record_spec


# --- the self-test ----------------------------------------------------------------------------


def _synthetic(shape: tuple[int, ...], dtype: np.dtype[Any], rng: np.random.Generator) -> Any:
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, 2, size=shape).astype(dtype)


def self_test(
    fn: Callable[..., Any], plan: Plan, server_leaves: Sequence[Any], record_tree: Any
) -> None:
    """Compares the interpreted plan with `jax.jit` of the program on 4 synthetic clients.

    Args:
        fn: The program.
        plan: Its plan.
        server_leaves: The server arguments' leaves.
        record_tree: The tree structure of one client record.

    Raises:
        AssertionError: A result differs (a program bridge_mr.beam interprets wrongly: please
            report it; pass check=False to skip the test).
    """
    count = sum(_CHECK_CLIENTS)
    rng = np.random.default_rng(0)
    stacked = [_synthetic((count, *shape), dtype, rng) for shape, dtype in plan.record_avals]
    got = _worker.interpret(plan, server_leaves, stacked, _CHECK_CLIENTS)
    expected = _reference(fn, plan, server_leaves, stacked, record_tree, count)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        b = np.asarray(b)
        scale = float(np.max(np.abs(b))) if b.size and np.issubdtype(b.dtype, np.number) else 1.0
        if (
            a.shape != b.shape
            or a.dtype != b.dtype
            or not np.allclose(a, b, rtol=1e-3, atol=1e-5 * max(scale, 1.0), equal_nan=True)
        ):
            raise AssertionError(
                f"bridge_mr.beam self-test: result leaf {i} of the program interpreted on "
                f"{count} synthetic clients differs from jax.jit of the program: got "
                f"{a.dtype}{list(a.shape)} {a!r}, expected {b.dtype}{list(b.shape)} {b!r}. "
                "This is a program bridge_mr.beam interprets wrongly; please report it "
                "(check=False skips this test)."
            )


def _reference(
    fn: Callable[..., Any],
    plan: Plan,
    server_leaves: Sequence[Any],
    stacked: Sequence[Any],
    record_tree: Any,
    count: int,
) -> list[Any]:
    server = jax.tree.unflatten(plan.server_tree, list(server_leaves))
    placed = jax.tree.unflatten(record_tree, [jnp.asarray(x) for x in stacked])
    program = jax_core.program(placements={plan.placement: count})(fn)
    return jax.tree.leaves(jax.jit(program)(*server, *placed))


# --- the public planning calls ----------------------------------------------------------------


def prepare(
    fn: Callable[..., Any],
    server_args: tuple[Any, ...],
    record_spec: tuple[Any, ...],
    *,
    placement: str,
    check: bool,
) -> tuple[Plan, list[np.ndarray[Any, Any]], Any]:
    """Splits `fn` for these types (cached), runs the self-test once per plan if `check`.

    Args:
        fn: The program (see `bridge_mr.beam.run`).
        server_args: A tuple of the server arguments.
        record_spec: One client's record (a tuple).
        placement: The placement name.
        check: Run the self-test on a plan not tested yet.

    Returns:
        (the plan, the server arguments' leaves as numpy arrays, one record's tree structure).

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline.
        TypeError: `fn` is not callable, `server_args` or `record_spec` is not a tuple, or a
            leaf is not an array.
        AssertionError: The self-test found a difference from `jax.jit`.
    """
    if not callable(fn):
        raise TypeError(f"bridge_mr.beam: fn must be callable; got {type(fn).__name__}.")
    if not isinstance(server_args, tuple):
        raise TypeError(
            "bridge_mr.beam: server_args is a tuple of fn's server arguments (those before "
            f"the placed ones); got {type(server_args).__name__}. Use (x,) for one."
        )
    record_spec = check_record_spec(record_spec)
    server_leaves = [np.asarray(x) for x in jax.tree.leaves(server_args)]
    server_specs = _specs(server_args, "server_args")
    record_specs = _specs(record_spec, "record_spec")
    plan = _plan_for(fn, server_specs, record_specs, placement)
    record_tree = plan.record_tree
    if check and id(plan) not in _CHECKED:
        self_test(fn, plan, server_leaves, record_tree)
        _CHECKED[id(plan)] = plan
    return plan, server_leaves, record_tree


def split(
    fn: Callable[..., Any],
    server_args: tuple[Any, ...],
    record_spec: tuple[Any, ...],
    *,
    placement: str = "clients",
) -> Plan:
    """Splits `fn` into the rounds `run` executes, without running anything.

    Needs no apache_beam.

    Args:
        fn: The program (see `run`).
        server_args: A tuple of the server arguments (arrays or `jax.ShapeDtypeStruct`).
        record_spec: One client's record (see `MapReduce`).
        placement: The placement name.

    Returns:
        The `Plan`: `plan.num_rounds`, `plan.segments` (server_0, client_0, ..., with their
        `jax.export` bytes), `plan.aggregations`.

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline.
        TypeError: `server_args` or `record_spec` is not a tuple.

    Example:
      >>> spec = (jax.ShapeDtypeStruct((), jnp.float32),)  # one client's record: x
      >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), spec)
      >>> plan.num_rounds, [segment.name for segment in plan.segments]
      (1, ['server_0', 'client_0', 'server_1'])
      >>> plan.aggregations
      [[Aggregation(kind='mean', shape=(), dtype=dtype('float32'))]]
    """
    if not isinstance(server_args, tuple):
        raise TypeError(
            f"split: server_args is a tuple of fn's server arguments; got "
            f"{type(server_args).__name__}."
        )
    return _plan_for(
        fn,
        _specs(server_args, "server_args"),
        _specs(check_record_spec(record_spec), "record_spec"),
        placement,
    )


def interpret(
    plan: Plan,
    server_args: tuple[Any, ...],
    client_records: Sequence[Any],
    *,
    bundle_sizes: Sequence[int] | None = None,
) -> Any:
    """Runs a plan in this process, without Beam, as the pipeline would.

    The same segments, bundles, float64 accumulators and merges as a pipeline: for checking
    a plan and for tests (the self-test of `run` uses it). Needs no apache_beam.

    Args:
        plan: From `split`.
        server_args: The server arguments (a tuple).
        client_records: The client records (tuples of the placed arguments).
        bundle_sizes: How to cut the clients into bundles (default: one bundle).

    Returns:
        The program's result.

    Raises:
        ValueError: A record does not match the plan's types, or the bundle sizes do not add
            up to the number of records.

    Example:
      >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
      >>> records = [(np.float32(x),) for x in range(4)]  # one 1-tuple per client
      >>> bridge_mr.beam.interpret(plan, (np.float32(2),), records, bundle_sizes=[1, 3])
      array(3., dtype=float32)
    """
    records = list(client_records)
    sizes = [len(records)] if bundle_sizes is None else [int(b) for b in bundle_sizes]
    if sum(sizes) != len(records) or any(b < 1 for b in sizes):
        raise ValueError(
            f"interpret: bundle_sizes {sizes} must be positive and add up to the "
            f"{len(records)} records."
        )
    stacked = _worker.stack_records(records, plan.record_tree, plan.record_avals, first_index=0)
    leaves = [np.asarray(x) for x in jax.tree.leaves(server_args)]
    return jax.tree.unflatten(plan.out_tree, _worker.interpret(plan, leaves, stacked, sizes))
