"""The apache_beam side: a plan as Beam transforms (`MapReduce`, `Aggregate`) and `run`.

With `_files`, the modules of bridge_mr.beam that import apache_beam; `bridge_mr.beam` imports
it on first use of these names, so planning (`split`, `interpret`) works without Beam installed.

The pipeline uses only transforms every runner supports, and no side input: the server state
reaches the bundles of clients through a `CoGroupByKey` (one copy per bundle key), and each
aggregation's partial accumulators meet the server state through another. A runner that emits
several partial aggregates, or several copies of a value, cannot make a round count clients
twice or lose them unnoticed: the server step merges every partial it receives and checks the
client count. (Beam's DaskRunner duplicates a side input that is also a main input: seen with
apache-beam 2.77 and dask 2026.8.)
"""

from __future__ import annotations

import itertools
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import apache_beam as beam
import jax
import numpy as np
from apache_beam.options.pipeline_options import (
    GoogleCloudOptions,
    PipelineOptions,
    StandardOptions,
)
from apache_beam.pvalue import PCollection

from . import _files, _waiting, _worker
from ._plan import Aggregation, Plan, Segment
from ._planning import check_record_spec, prepare

#: The in-process runner used when the options name none: the FnApiRunner that Beam's
#: DirectRunner itself runs batch pipelines on (the DirectRunner first tries Prism, which
#: downloads a binary).
DEFAULT_RUNNER = "FnApiRunner"
DEFAULT_BUNDLE_SIZE = 256
#: How many keys `MapReduce` spreads the records over (the server state is copied once per key
#: and round): at most this many groups of bundles run in parallel.
BUNDLE_KEYS = 16

State = tuple[int, list[Any]]  # (the client count, the server values)


def _only(values: Iterable[Any], what: str, where: str) -> Any:
    """The one element of `values`; an error naming the runner's fault otherwise."""
    found = list(values)
    if len(found) != 1:
        raise RuntimeError(
            f"bridge_mr.beam: {where} received {len(found)} {what}s, expected exactly one: the "
            "runner duplicated or split a value of the pipeline. Please report it with the "
            "runner's name and version."
        )
    return found[0]


class _ClientWork(beam.DoFn):
    """client_work: runs round k's client segment on each bundle of a key's group."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def process(self, element: tuple[int, dict[str, Iterable[Any]]]) -> Iterable[Any]:
        key, groups = element
        bundles = list(groups["bundles"])
        if not bundles:
            return
        state = _only(groups["state"], "server state", self._segment.name)
        for bundle in bundles:
            yield key, _worker.run_client(self._segment, bundle, state[1])


class Aggregate(beam.CombineFn):
    """client_to_server_aggregation: one round's sums over clients, accumulated in float64.

    An input is a bundle's contributions (one array per aggregation, the bundle's clients
    first); the accumulator holds the client count and the running sums (float64, int64 for
    integers, complex128); merging adds them, so any order and grouping gives the same sums.
    The output is the merged accumulator, a *partial* aggregate: `finish` merges any number of
    partials (one per partition, if a runner emits that) and gives (count, the aggregations in
    the program's dtypes, means divided by the count).

    In a pipeline: `contributions | beam.CombineGlobally(Aggregate(plan.aggregations[k]))`.

    Args:
        aggregations: The round's aggregations: `plan.aggregations[k]` of a `split` plan.

    Example:
      >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
      >>> aggregate = bridge_mr.beam.Aggregate(plan.aggregations[0])  # one mean
      >>> two = aggregate.add_input(aggregate.create_accumulator(), [np.float32([2, 4])])
      >>> one = aggregate.add_input(aggregate.create_accumulator(), [np.float32([6])])
      >>> partial = aggregate.extract_output(aggregate.merge_accumulators([one, two]))
      >>> partial  # 3 clients, their float64 sum
      [3, np.float64(12.0)]
      >>> aggregate.finish([partial])  # the mean, in the program's dtype
      (3, [array(4., dtype=float32)])
    """

    def __init__(self, aggregations: Sequence[Aggregation]) -> None:
        super().__init__()
        self._aggregations = list(aggregations)

    def create_accumulator(self) -> _worker.Accumulator:
        """An empty accumulator: no clients, no sums yet."""
        return _worker.create_accumulator(len(self._aggregations))

    def add_input(self, mutable_accumulator: Any, element: Any) -> _worker.Accumulator:
        """Adds a bundle's contributions (one array per aggregation, clients first)."""
        return _worker.add_contributions(mutable_accumulator, element)

    def merge_accumulators(self, accumulators: Iterable[Any]) -> _worker.Accumulator:
        """Adds partial accumulators' counts and sums (any order, any grouping)."""
        return _worker.merge_accumulators(list(accumulators))

    def extract_output(self, accumulator: Any) -> _worker.Accumulator:
        """The partial aggregate: the accumulator (client count, float64 sums)."""
        return accumulator

    def finish(
        self, partials: Iterable[_worker.Accumulator], expected: int | None = None
    ) -> tuple[int, list[np.ndarray[Any, Any]]]:
        """Merges partial aggregates: (the client count, the aggregations in the program's dtypes).

        Args:
            partials: Outputs of this CombineFn (any number, any grouping of the clients).
            expected: The client count the round must have seen (None: unchecked).

        Returns:
            (count, one array per aggregation; means divided by the count).

        Raises:
            ValueError: No client contributed, or the count is not `expected` (clients lost
                or counted twice).

        Example:
          >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
          >>> aggregate = bridge_mr.beam.Aggregate(plan.aggregations[0])  # one mean
          >>> partials = [  # one per partition: 2 clients, then 1
          ...     aggregate.add_input(aggregate.create_accumulator(), [np.float32([2, 4])]),
          ...     aggregate.add_input(aggregate.create_accumulator(), [np.float32([6])]),
          ... ]
          >>> aggregate.finish(partials, expected=3)
          (3, [array(4., dtype=float32)])
        """
        # An empty accumulator first: merging it changes nothing, and no partial is no client.
        merged = _worker.merge_accumulators([self.create_accumulator(), *partials])
        return _worker.extract(merged, self._aggregations, expected)


def _server_prepare(count: int, *, segment: Segment, leaves: Sequence[Any]) -> State:
    return count, _worker.run_server(segment, leaves, [], count)


def _server_step(
    element: tuple[int, dict[str, Iterable[Any]]], *, segment: Segment, aggregate: Aggregate
) -> State:
    _, groups = element
    expected, env = _only(groups["state"], "server state", segment.name)
    count, reduced = aggregate.finish(groups["aggregate"], expected)
    return count, _worker.run_server(segment, env, reduced, count)


def _fan_out(state: State, *, keys: Sequence[int]) -> Iterable[tuple[int, State]]:
    return ((key, state) for key in keys)


def _keyed(value: Any) -> tuple[int, Any]:
    return 0, value


def _carry(element: tuple[int, Any]) -> tuple[int, Any]:
    key, (carry, _) = element
    return key, carry


def _contributions(element: tuple[int, Any]) -> Any:
    return element[1][1]


def _finish(state: State, *, outputs: list[tuple[str, Any]], tree: Any) -> Any:
    env = state[1]
    leaves = [np.asarray(env[i]) if kind == "env" else np.asarray(i) for kind, i in outputs]
    return jax.tree.unflatten(tree, leaves)


def _expand_plan(
    plan: Plan, bundles: Any, count: Any, server_leaves: Sequence[Any], keys: Sequence[int]
) -> Any:
    """The rounds of `plan` as Beam transforms; returns the PCollection of its one result.

    `bundles` holds (key, a bundle's stacked records) with keys among `keys`; `count` holds
    the client count.
    """
    state = count | "server_prepare_0" >> beam.Map(
        _server_prepare, segment=plan.server_segment(0), leaves=[*server_leaves, *plan.consts]
    )
    for k in range(plan.num_rounds):
        fanned = state | f"broadcast_{k}" >> beam.FlatMap(_fan_out, keys=list(keys))
        worked = (
            {"bundles": bundles, "state": fanned}
            | f"join_{k}" >> beam.CoGroupByKey()
            | f"client_work_{k}" >> beam.ParDo(_ClientWork(plan.client_segment(k)))
        )
        aggregate = Aggregate(plan.aggregations[k])
        partials = (
            worked
            | f"contributions_{k}" >> beam.Map(_contributions)
            # No default for an empty input: it would be a side input (see the module doc).
            | f"aggregate_{k}" >> beam.CombineGlobally(aggregate).without_defaults()
        )
        bundles = worked | f"carry_{k}" >> beam.Map(_carry)
        name = "server_result" if k == plan.num_rounds - 1 else f"server_prepare_{k + 1}"
        state = (
            {
                "state": state | f"state_{k}" >> beam.Map(_keyed),
                "aggregate": partials | f"partials_{k}" >> beam.Map(_keyed),
            }
            | f"gather_{k}" >> beam.CoGroupByKey()
            | name
            >> beam.Map(_server_step, segment=plan.server_segment(k + 1), aggregate=aggregate)
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
        count = records | "count_clients" >> beam.combiners.Count.Globally().without_defaults()
        # Bundles from a GroupByKey, not BatchElements: the DaskRunner drops what a DoFn emits
        # in finish_bundle (BatchElements' last batch; the client count would catch it).
        bundles = (
            records
            | "key_records" >> beam.Map(_random_key, keys=BUNDLE_KEYS)
            | "group_records" >> beam.GroupByKey()
            | "bundle"
            >> beam.FlatMap(
                _bundles,
                size=self._bundle_size,
                treedef=record_tree,
                avals=plan.record_avals,
            )
        )
        return _expand_plan(plan, bundles, count, server_leaves, range(BUNDLE_KEYS))


def _random_key(record: Any, *, keys: int) -> tuple[int, Any]:
    return random.randrange(keys), record


def _bundles(
    group: tuple[int, Iterable[Any]], *, size: int, treedef: Any, avals: Any
) -> Iterable[tuple[int, list[Any]]]:
    """A key's records, checked and stacked in bundles of at most `size` clients."""
    key, records = group
    iterator = iter(records)
    while chunk := list(itertools.islice(iterator, size)):
        yield key, _worker.stack_records(chunk, treedef, avals, first_index=None)


def _check_bundle_size(bundle_size: int) -> int:
    if isinstance(bundle_size, bool) or not isinstance(bundle_size, int) or bundle_size < 1:
        raise ValueError(
            f"bundle_size must be a positive int (clients per segment call); got {bundle_size!r}."
        )
    return bundle_size


class _Collect(beam.DoFn):
    """Writes the pipeline's one result to `path` (any Beam filesystem); run reads it back."""

    def __init__(self, path: str) -> None:
        self._path = path

    def process(self, element: Any) -> Iterable[None]:
        _files.write_object(self._path, element)
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
    """Reads a bundle of clients (rows start:stop of each stacked leaf) through FileSystems."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = list(paths)

    def process(self, element: tuple[int, tuple[int, int]]) -> Iterable[tuple[int, list[Any]]]:
        key, (start, stop) = element
        yield key, [_files.read_rows(path, start, stop) for path in self._paths]


def _work_directory(options: PipelineOptions, own: str) -> str:
    """A fresh directory for a run's files: under the options' temp_location, else `own`."""
    base = options.view_as(GoogleCloudOptions).temp_location
    return _files.new_directory(own if base is None else base)


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
    CoGroupByKey of the server state with the bundles of clients) → client_work (a ParDo over
    the bundles) → aggregation (a CombineFn summing in float64, counting clients) →
    server_result; each segment ships as `jax.export` bytes. The records and the result travel
    through Beam's FileSystems, under the options' `temp_location` (any path the workers can
    open: local, gs://, s3://, ...) or, without one, a temporary directory of this machine.
    Before the first run of a program, a self-test (`check`) interprets it on 4 synthetic
    clients and compares with `jax.jit` of the program.

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
            On a cluster whose workers do not share this machine's disk, set
            `temp_location` to a path they can reach (e.g. gs://bucket/tmp).
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
        return _run_and_collect(pipeline, result, None)
    records = list(client_records)
    if not records:
        raise ValueError("bridge_mr.beam.run: client_records is empty; give at least one client.")
    spec = check_record_spec(records[0] if record_spec is None else record_spec)
    plan, server_leaves, record_tree = prepare(
        fn, server_args, spec, placement=placement, check=check
    )
    stacked = _worker.stack_records(records, record_tree, plan.record_avals, first_index=0)
    bounds = [(a, min(a + bundle_size, len(records))) for a in range(0, len(records), bundle_size)]
    pipeline = beam.Pipeline(options=_options(pipeline_options))
    # The records go through files, not the pipeline's payload (Beam pickles and compresses
    # whatever a transform holds, once per bundle processor).
    count = pipeline | "count_clients" >> beam.Create([len(records)])
    with tempfile.TemporaryDirectory(prefix="bridge_mr_beam_") as own:
        directory = _work_directory(pipeline.options, own)
        try:
            paths = [_files.join(directory, f"leaf_{i}.npy") for i in range(len(stacked))]
            for path, leaf in zip(paths, stacked, strict=True):
                _files.write_array(path, leaf)
            bundles = (
                pipeline
                | "bundles" >> beam.Create(list(enumerate(bounds)))
                | "read_clients" >> beam.ParDo(_ReadClients(paths))
            )
            result = _expand_plan(plan, bundles, count, server_leaves, range(len(bounds)))
            return _run_and_collect(pipeline, result, directory)
        finally:
            _files.delete_tree([directory])


def _run_and_collect(pipeline: beam.Pipeline, result: Any, directory: str | None) -> Any:
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="bridge_mr_beam_") as own:
            directory = _work_directory(pipeline.options, own)
            try:
                return _run_and_collect(pipeline, result, directory)
            finally:
                _files.delete_tree([directory])
    path = _files.join(directory, "result.pkl")
    _ = result | "collect" >> beam.ParDo(_Collect(path))
    started = time.time()
    _waiting.wait(pipeline.run(), started)
    if not _files.exists(path):  # No record, no count: the rounds never ran.
        raise ValueError("bridge_mr.beam.run: the PCollection of client records is empty.")
    return _files.read_object(path)
