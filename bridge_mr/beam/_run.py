"""`run` and the `MapReduce` PTransform: a split program as a Beam pipeline."""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import apache_beam as beam
import jax
import jax.numpy as jnp
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.pvalue import AsSingleton, PCollection

from bridge_mr import jax_core
from bridge_mr._compat.jax import trace_context

from . import _worker
from ._plan import Plan, Reduction, Segment
from ._split import split as split_program

#: The in-process runner used when the options name none: the FnApiRunner that Beam's
#: DirectRunner itself runs batch pipelines on (the DirectRunner first tries Prism, which
#: downloads a binary).
DEFAULT_RUNNER = "FnApiRunner"
DEFAULT_BUNDLE_SIZE = 256
_CHECK_CLIENTS = (2, 2)  # The self-test's bundles: 4 clients, two accumulators merged.

_PLANS: weakref.WeakKeyDictionary[Any, dict[Any, Plan]] = weakref.WeakKeyDictionary()
_CHECKED: dict[int, Plan] = {}  # Self-tested plans (held, so that their ids stay theirs).
_PLANS_LOCK = threading.Lock()


# --- plans ------------------------------------------------------------------------------------


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
        plans = _PLANS.setdefault(fn, {})
        plan = plans.get(key)
    if plan is None:
        plan = split_program(fn, server_specs, record_spec, placement=placement)
        with _PLANS_LOCK:
            plans[key] = plan
    return plan


def _check_record_spec(record_spec: Any) -> tuple[Any, ...]:
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


# --- Beam -------------------------------------------------------------------------------------


class _ClientWork(beam.DoFn):
    """client_work: runs round k's client segment on a bundle of clients."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def process(self, bundle: Sequence[Any], state: tuple[int, Sequence[Any]]) -> Iterable[Any]:
        yield _worker.run_client(self._segment, bundle, state[1])


class Aggregate(beam.CombineFn):
    """client_to_server_aggregation: one round's sums over clients, accumulated in float64.

    An input is a bundle's contributions (one array per reduction, the bundle's clients
    first); the accumulator holds the client count and the running sums (float64, int64 for
    integers, complex128); merging adds them, so any order and grouping gives the same sums;
    the output is (count, the reductions in the program's dtypes, means divided by the count).

    Args:
        reductions: The round's reductions: `plan.reductions[k]` of a `split` plan.

    Example::

        sums = contributions | beam.CombineGlobally(Aggregate(plan.reductions[0]))
    """

    def __init__(self, reductions: Sequence[Reduction]) -> None:
        super().__init__()
        self._reductions = list(reductions)

    def create_accumulator(self) -> _worker.Accumulator:
        return _worker.create_accumulator(len(self._reductions))

    def add_input(self, mutable_accumulator: Any, element: Any) -> _worker.Accumulator:
        return _worker.add_contributions(mutable_accumulator, element)

    def merge_accumulators(self, accumulators: Iterable[Any]) -> _worker.Accumulator:
        return _worker.merge_accumulators(list(accumulators))

    def extract_output(self, accumulator: Any) -> tuple[int, list[np.ndarray[Any, Any]]]:
        return _worker.extract(accumulator, self._reductions, None)


def _server_prepare(
    count: int, *, segment: Segment, leaves: Sequence[Any]
) -> tuple[int, list[Any]]:
    return count, _worker.run_server(segment, leaves, [], count)


def _server_step(
    state: tuple[int, Sequence[Any]], aggregated: tuple[int, Sequence[Any]], *, segment: Segment
) -> tuple[int, list[Any]]:
    expected, env = state
    count, reduced = aggregated
    if count != expected:
        raise ValueError(
            f"bridge_mr.beam: the aggregation counted {count} clients, expected {expected} "
            "(records were lost or duplicated between rounds)."
        )
    return count, _worker.run_server(segment, env, reduced, count)


def _first(pair: tuple[Any, Any]) -> Any:
    return pair[0]


def _second(pair: tuple[Any, Any]) -> Any:
    return pair[1]


def _finish(state: tuple[int, Sequence[Any]], *, outputs: list[tuple[str, Any]], tree: Any) -> Any:
    env = state[1]
    leaves = [np.asarray(env[i]) if kind == "env" else np.asarray(i) for kind, i in outputs]
    return jax.tree.unflatten(tree, leaves)


def _expand_plan(plan: Plan, bundles: Any, count: Any, server_leaves: Sequence[Any]) -> Any:
    """The rounds of `plan` as Beam transforms; returns the PCollection of its one result."""
    state = count | "server_prepare_0" >> beam.Map(
        _server_prepare, segment=plan.server_segment(0), leaves=[*server_leaves, *plan.consts]
    )
    for k in range(plan.num_rounds):
        worked = bundles | f"client_work_{k}" >> beam.ParDo(
            _ClientWork(plan.client_segment(k)), AsSingleton(state)
        )
        aggregated = (
            worked
            | f"contributions_{k}" >> beam.Map(_second)
            | f"aggregate_{k}" >> beam.CombineGlobally(Aggregate(plan.reductions[k]))
        )
        bundles = worked | f"carry_{k}" >> beam.Map(_first)
        name = "server_result" if k == plan.num_rounds - 1 else f"server_prepare_{k + 1}"
        state = state | name >> beam.Map(
            _server_step,
            AsSingleton(aggregated),
            segment=plan.server_segment(k + 1),
        )
    return state | "result" >> beam.Map(_finish, outputs=plan.outputs, tree=plan.out_tree)


class MapReduce(beam.PTransform):
    """A MapReduce program as a Beam transform: client records in, its one result out.

    `records | MapReduce(fn, server_args, record_spec)` is a PCollection holding one element,
    what `program(placements={placement: N})(fn)(*server_args, *stacked_records)` returns for
    the N records of `records` (each a tuple of `fn`'s placed arguments for one client).
    Compose it with your own sources and sinks; `run` uses it.

    Args:
        fn: The program (see `run`).
        server_args: A tuple of `fn`'s server arguments (pytrees of arrays).
        record_spec: One client's record: a tuple of pytrees of `jax.ShapeDtypeStruct` (or
            of example arrays) giving the placed arguments' per-client types.
        placement: The placement name `fn`'s primitives use.
        bundle_size: At most this many clients per call of the client segment.
        check: Run the self-test (see `run`) when the transform is built.

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline.
        TypeError: `server_args` or `record_spec` is not a tuple, or a leaf is not an array.

    Example::

        with beam.Pipeline(runner="FnApiRunner") as p:
            (p | beam.Create(records) | bridge_mr.beam.MapReduce(fedavg_round, (server,), spec)
               | beam.Map(print))
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        server_args: tuple[Any, ...],
        record_spec: tuple[Any, ...],
        *,
        placement: str = "clients",
        bundle_size: int = DEFAULT_BUNDLE_SIZE,
        check: bool = True,
    ) -> None:
        super().__init__()
        self._prepared = prepare(fn, server_args, record_spec, placement=placement, check=check)
        self._bundle_size = _check_bundle_size(bundle_size)

    def expand(self, input_or_inputs: Any) -> Any:
        records = input_or_inputs
        plan, server_leaves, record_tree = self._prepared
        count = records | "count_clients" >> beam.combiners.Count.Globally()
        bundles = (
            records
            | "bundle" >> beam.BatchElements(min_batch_size=1, max_batch_size=self._bundle_size)
            | "stack"
            >> beam.Map(
                _worker.stack_records,
                treedef=record_tree,
                avals=plan.record_avals,
                first_index=None,
            )
        )
        return _expand_plan(plan, bundles, count, server_leaves)


def _check_bundle_size(bundle_size: int) -> int:
    if isinstance(bundle_size, bool) or not isinstance(bundle_size, int) or bundle_size < 1:
        raise ValueError(
            f"bundle_size must be a positive int (clients per segment call); got {bundle_size!r}."
        )
    return bundle_size


def prepare(
    fn: Callable[..., Any],
    server_args: tuple[Any, ...],
    record_spec: tuple[Any, ...],
    *,
    placement: str,
    check: bool,
) -> tuple[Plan, list[np.ndarray[Any, Any]], Any]:
    """Splits `fn` for these types (cached), runs the self-test once per plan if `check`."""
    if not callable(fn):
        raise TypeError(f"bridge_mr.beam: fn must be callable; got {type(fn).__name__}.")
    if not isinstance(server_args, tuple):
        raise TypeError(
            "bridge_mr.beam: server_args is a tuple of fn's server arguments (those before "
            f"the placed ones); got {type(server_args).__name__}. Use (x,) for one."
        )
    record_spec = _check_record_spec(record_spec)
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

    Args:
        fn: The program (see `run`).
        server_args: A tuple of the server arguments (arrays or `jax.ShapeDtypeStruct`).
        record_spec: One client's record (see `MapReduce`).
        placement: The placement name.

    Returns:
        The `Plan`: `plan.num_rounds`, `plan.segments` (server_0, client_0, ..., with their
        `jax.export` bytes), `plan.reductions`.

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline.
        TypeError: `server_args` or `record_spec` is not a tuple.

    Example::

        plan = bridge_mr.beam.split(fedavg_round, (server,), (batch_spec, weight_spec))
        assert plan.num_rounds == 1
    """
    if not isinstance(server_args, tuple):
        raise TypeError(
            f"split: server_args is a tuple of fn's server arguments; got "
            f"{type(server_args).__name__}."
        )
    return _plan_for(
        fn,
        _specs(server_args, "server_args"),
        _specs(_check_record_spec(record_spec), "record_spec"),
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
    a plan and for tests (the self-test of `run` uses it).

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

    Example::

        result = bridge_mr.beam.interpret(plan, (server,), records, bundle_sizes=[3, 5])
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


# --- run --------------------------------------------------------------------------------------


class _Collect(beam.DoFn):
    """Writes the pipeline's one result to a file of this machine (run reads it back)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def process(self, element: Any) -> Iterable[None]:
        with open(self._path, "wb") as f:
            pickle.dump(element, f)
        return ()


def _options(pipeline_options: PipelineOptions | None) -> PipelineOptions:
    # Not PipelineOptions(): with no flags it parses sys.argv (the caller's own flags).
    options = PipelineOptions([]) if pipeline_options is None else pipeline_options
    if not isinstance(options, PipelineOptions):
        raise TypeError(
            "pipeline_options must be an apache_beam PipelineOptions (e.g. "
            f"PipelineOptions(runner='FlinkRunner', ...)); got {type(options).__name__}."
        )
    if options.view_as(StandardOptions).runner is None:
        options.view_as(StandardOptions).runner = DEFAULT_RUNNER
    return options


class _ReadClients(beam.DoFn):
    """Reads a bundle of clients from the stacked records `run` saved (memory-mapped)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = list(paths)
        self._leaves: list[Any] = []

    def setup(self) -> None:
        self._leaves = [np.load(path, mmap_mode="r") for path in self._paths]

    def process(self, bounds: tuple[int, int]) -> Iterable[list[Any]]:
        start, stop = bounds
        yield [np.array(leaf[start:stop]) for leaf in self._leaves]


def run(
    fn: Callable[..., Any],
    server_args: tuple[Any, ...],
    client_records: Iterable[Any] | PCollection,
    *,
    placement: str = "clients",
    pipeline_options: PipelineOptions | None = None,
    record_spec: tuple[Any, ...] | None = None,
    bundle_size: int = DEFAULT_BUNDLE_SIZE,
    check: bool = True,
) -> Any:
    """Runs the MapReduce program `fn` as an Apache Beam pipeline and returns its result.

    Returns what `program(placements={placement: N})(fn)(*server_args, *stacked)` returns,
    where `stacked` stacks the N client records leaf by leaf. `fn` is traced once per argument
    types with a symbolic client count and split into rounds of server_prepare → broadcast (a
    side input) → client_work (a ParDo over bundles of clients) → aggregation (a CombineFn
    summing in float64, counting clients) → server_result; each segment ships as
    `jax.export` bytes. Before the first run of a program, a self-test (`check`) interprets it
    on 3 synthetic clients and compares with `jax.jit` of the program.

    Args:
        fn: `fn(*server_args, *placed_args)`, built with `broadcast` / `map_fn` / the
            reductions of `bridge_mr.jax_core` (or the top-level names) under no `program`:
            `run` supplies the placement. It must return server values only.
        server_args: A tuple of the server arguments (pytrees of arrays).
        client_records: The clients' records, each a tuple of `fn`'s placed arguments for one
            client (pytrees of arrays without the client axis): an iterable, or a PCollection
            of a pipeline (which `run` then runs; give `record_spec`).
        placement: The placement name.
        pipeline_options: Beam's options (runner and its settings); None, or options that
            name no runner, use the in-process `FnApiRunner` (DirectRunner's batch engine).
            The result comes back through a file on this machine: for a cluster, use
            `MapReduce` in your own pipeline and write the result with a Beam sink.
        record_spec: One record's types (a tuple of pytrees of `jax.ShapeDtypeStruct` or
            arrays); default: the first record's.
        bundle_size: At most this many clients per call of a client segment.
        check: Run the self-test before the program's first run.

    Returns:
        The program's result (numpy arrays, in the program's pytree structure).

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline (it names why).
        ValueError: No client records, a record whose structure, shape or dtype differs from
            the first's (naming the record), or a PCollection without `record_spec`.
        TypeError: `server_args` or a record is not a tuple, or a leaf is not an array.
        AssertionError: The self-test found a difference from `jax.jit`.

    Example::

        new_server = bridge_mr.beam.run(fedavg_round, (server,), [(x, w) for x, w in data])
    """
    bundle_size = _check_bundle_size(bundle_size)
    options = _options(pipeline_options)
    if isinstance(client_records, PCollection):
        if record_spec is None:
            raise ValueError(
                "bridge_mr.beam.run: client_records is a PCollection, so give record_spec (one "
                "record's types: a tuple of pytrees of jax.ShapeDtypeStruct)."
            )
        pipeline = client_records.pipeline
        result = client_records | MapReduce(
            fn, server_args, record_spec, placement=placement, bundle_size=bundle_size, check=check
        )
        return _run_and_collect(pipeline, result)
    records = list(client_records)
    if not records:
        raise ValueError("bridge_mr.beam.run: client_records is empty; give at least one client.")
    spec = _check_record_spec(records[0] if record_spec is None else record_spec)
    plan, server_leaves, record_tree = prepare(
        fn, server_args, spec, placement=placement, check=check
    )
    stacked = _worker.stack_records(records, record_tree, plan.record_avals, first_index=0)
    bounds = [(a, min(a + bundle_size, len(records))) for a in range(0, len(records), bundle_size)]
    with tempfile.TemporaryDirectory(prefix="bridge_mr_beam_") as tmp:
        # The records go through files, not the pipeline's payload (Beam pickles and
        # compresses whatever a transform holds, once per bundle processor).
        paths = [os.path.join(tmp, f"leaf_{i}.npy") for i in range(len(stacked))]
        for path, leaf in zip(paths, stacked, strict=True):
            np.save(path, leaf)
        pipeline = beam.Pipeline(options=options)
        count = pipeline | "count_clients" >> beam.Create([len(records)])
        bundles = (
            pipeline
            | "bundles" >> beam.Create(bounds)
            | "read_clients" >> beam.ParDo(_ReadClients(paths))
        )
        result = _expand_plan(plan, bundles, count, server_leaves)
        return _run_and_collect(pipeline, result, tmp)


def _run_and_collect(pipeline: beam.Pipeline, result: Any, tmp: str | None = None) -> Any:
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix="bridge_mr_beam_") as own:
            return _run_and_collect(pipeline, result, own)
    path = os.path.join(tmp, "result.pkl")
    _ = result | "collect" >> beam.ParDo(_Collect(path))
    pipeline.run().wait_until_finish()
    with open(path, "rb") as f:
        return pickle.load(f)
