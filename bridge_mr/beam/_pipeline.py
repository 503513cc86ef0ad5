"""The apache_beam side: a plan as Beam transforms (`MapReduce`, `Aggregate`) and `run`.

The one module of bridge_mr.beam that imports apache_beam; `bridge_mr.beam` imports it on
first use of these names, so planning (`split`, `interpret`) works without Beam installed.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import apache_beam as beam
import jax
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.pvalue import AsSingleton, PCollection

from . import _worker
from ._plan import Plan, Reduction, Segment
from ._planning import check_record_spec, prepare

#: The in-process runner used when the options name none: the FnApiRunner that Beam's
#: DirectRunner itself runs batch pipelines on (the DirectRunner first tries Prism, which
#: downloads a binary).
DEFAULT_RUNNER = "FnApiRunner"
DEFAULT_BUNDLE_SIZE = 256


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

    In a pipeline: `contributions | beam.CombineGlobally(Aggregate(plan.reductions[k]))`.

    Args:
        reductions: The round's reductions: `plan.reductions[k]` of a `split` plan.

    Example:
      >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
      >>> aggregate = bridge_mr.beam.Aggregate(plan.reductions[0])  # one mean
      >>> two = aggregate.add_input(aggregate.create_accumulator(), [np.float32([2, 4])])
      >>> one = aggregate.add_input(aggregate.create_accumulator(), [np.float32([6])])
      >>> aggregate.extract_output(aggregate.merge_accumulators([one, two]))  # 3 clients
      (3, [array(4., dtype=float32)])
    """

    def __init__(self, reductions: Sequence[Reduction]) -> None:
        super().__init__()
        self._reductions = list(reductions)

    def create_accumulator(self) -> _worker.Accumulator:
        """An empty accumulator: no clients, no sums yet."""
        return _worker.create_accumulator(len(self._reductions))

    def add_input(self, mutable_accumulator: Any, element: Any) -> _worker.Accumulator:
        """Adds a bundle's contributions (one array per reduction, clients first)."""
        return _worker.add_contributions(mutable_accumulator, element)

    def merge_accumulators(self, accumulators: Iterable[Any]) -> _worker.Accumulator:
        """Adds partial accumulators' counts and sums (any order, any grouping)."""
        return _worker.merge_accumulators(list(accumulators))

    def extract_output(self, accumulator: Any) -> tuple[int, list[np.ndarray[Any, Any]]]:
        """(The client count, the reductions in the program's dtypes, means divided by it)."""
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
        ValueError: `bundle_size` is not a positive int.
        AssertionError: The self-test found a difference from `jax.jit`.

    Example:
      >>> import apache_beam as beam
      >>> records = [(np.float32(x),) for x in range(4)]  # one 1-tuple per client
      >>> with beam.Pipeline(runner="FnApiRunner") as p:  # 2 * mean([0, 1, 2, 3])
      ...     _ = (
      ...         p
      ...         | beam.Create(records)
      ...         | bridge_mr.beam.MapReduce(scaled_mean, (np.float32(2),), records[0])
      ...         | beam.Map(print)
      ...     )
      3.0
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
        """The PCollection of the program's result, from the PCollection of client records."""
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
            the first's (naming the record), a PCollection without `record_spec`, or a
            `bundle_size` that is not a positive int.
        TypeError: `server_args` or a record is not a tuple, or a leaf is not an array.
        AssertionError: The self-test found a difference from `jax.jit`.

    Example:
      >>> records = [(np.float32(x),) for x in range(4)]  # one 1-tuple per client
      >>> bridge_mr.beam.run(scaled_mean, (np.float32(2),), records)  # 2 * mean([0, 1, 2, 3])
      array(3., dtype=float32)
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
    spec = check_record_spec(records[0] if record_spec is None else record_spec)
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
