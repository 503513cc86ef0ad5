"""Case "beam": FedAvg rounds on Apache Beam (in-process, and on Dask) against jit.

Linear-model rows ("beam/cN"): `bridge_mr.beam.run` of a FedAvg round (3 local SGD steps of
a linear model per client, a weighted mean) for 16 to 10,000 clients (quick: 16 to 2,048) on the
FnApiRunner (the engine of Beam's DirectRunner for batch pipelines), and `jax.jit` of the same
program on the stacked records, and the same Beam pipeline on Beam's DaskRunner over a
dask.distributed LocalCluster of 2 worker processes; the three alternatives interleaved round by
round, the load average beside each round. Fixed and per-client cost come from a least-squares
line through each runner's times; an untimed run first makes the plan, its self-test and the
compilations (once per program and bundle size in a worker process).

CNN rows ("beam-cnn/cN"): the round of examples/fedavg_beam.py (a 3x3 convolution with 8
channels, max-pooling, 5 local SGD steps on 48 digit-sized images per client, inside map_fn)
for 8 to 128 clients (quick: 8 and 32), on a fresh LocalCluster of 2 worker processes, the
clients in one bundle per worker. The same interleaved rounds and lines (jit's too), and a
"first call" row: each alternative's first call after `bridge_mr.clear_caches()` (jit: trace
and compile; Beam: trace, plan, self-test, pipeline, each worker's imports and compilations),
what a user meets before the later rounds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .. import harness, report

FN_API = "beam FnApiRunner"
DASK = "beam DaskRunner (2 workers)"

DIM, EXAMPLES = 32, 16
EXAMPLE = os.path.join(harness.PACKAGE_ROOT, "examples", "fedavg_beam.py")


def _program() -> Any:
    import jax
    import jax.numpy as jnp

    from bridge_mr import jax_core

    def local(params: Any, data: Any) -> Any:
        def loss(p: Any) -> Any:
            return jnp.mean((data["x"] @ p["w"] + p["b"] - data["y"]) ** 2)

        def step(p: Any, _: Any) -> Any:
            return jax.tree.map(lambda a, g: a - 0.05 * g, p, jax.grad(loss)(p)), None

        new, _ = jax.lax.scan(step, params, None, length=3)
        return jax.tree.map(jnp.subtract, new, params)

    def fedavg_round(server: Any, data: Any, weight: Any) -> Any:
        deltas = jax_core.map_fn(local, (jax_core.broadcast(server), data))
        update = jax_core.reduce_weighted_mean(deltas, weight)
        return jax.tree.map(jnp.add, server, update)

    return fedavg_round


def _row(
    fn: Any, server: Any, rng: Any, count: int, reps: int, dask_options: Any
) -> dict[str, Any]:
    """The row of `count` clients: jit of the stacked records, Beam of the records on the
    in-process runner and on the Dask cluster, interleaved, with the load per round."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bridge_mr
    import bridge_mr.beam

    records = [
        (
            {
                "x": rng.normal(size=(EXAMPLES, DIM)).astype(np.float32),
                "y": rng.normal(size=EXAMPLES).astype(np.float32),
            },
            np.float32(rng.uniform(1, 2)),
        )
        for _ in range(count)
    ]
    # np.stack: jnp.stack of 10,000 arrays compiles a 10,000-operand concatenate.
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *records)
    jitted = jax.jit(bridge_mr.program(placements={"clients": count})(fn))
    harness.sync(jitted(server, *stacked))  # Compile.
    runners = {FN_API: None, DASK: dask_options}
    # Untimed: the plan, its self-test, and the client segment compiled for these bundle sizes
    # (each worker process compiles each size once).
    for options in runners.values():
        bridge_mr.beam.run(fn, (server,), records, pipeline_options=options)

    def beam_call(options: Any) -> Any:
        return lambda: lambda: bridge_mr.beam.run(fn, (server,), records, pipeline_options=options)

    measured = harness.rounds(
        {
            "jit": lambda: lambda: harness.sync(jitted(server, *stacked)),
            **{name: beam_call(options) for name, options in runners.items()},
        },
        max(reps, 3),
    )
    jit_entry = harness.Timing(measured.seconds["jit"], 1).summary()
    alternatives = {"jit": jit_entry}
    for name in runners:
        entry = harness.Timing(measured.seconds[name], 1).summary()
        entry["ratio_to_baseline"] = {"median": entry["median_s"] / jit_entry["median_s"]}
        alternatives[name] = entry
    for entry in alternatives.values():
        entry["client_updates_per_s"] = count / entry["median_s"]
    return {
        "id": f"beam/c{count}",
        "params": {"clients": count, "dim": DIM, "examples": EXAMPLES},
        "baseline": "jit",
        "alternatives": alternatives,
        "load_1min": measured.load_1min,
    }


def run(ctx: harness.Context) -> report.CaseResult:
    """The beam case: the linear model's rows, then the CNN's on a fresh cluster."""
    import numpy as np

    counts = ctx.clients or ((16, 256, 2048) if ctx.quick else (16, 100, 1000, 10000))
    cnn_counts = ctx.clients or ((8, 32) if ctx.quick else (8, 32, 128))
    reps = 2 if ctx.quick else 3
    fn = _program()
    rng = np.random.default_rng(0)
    server = {"w": np.zeros(DIM, np.float32), "b": np.float32(0.0)}
    title = (
        "FedAvg rounds (linear model; the example's CNN) on Beam (FnApiRunner; DaskRunner, 2 "
        "workers) vs the same round in jit"
    )
    unit = "seconds per round; (x) = ratio to jit; upd/s = client updates per second"
    with report.case_result("beam", title, unit) as case:
        with _dask_cluster() as (dask_options, _):
            harness.each(
                counts,
                "beam",
                lambda count: case.rows.append(_row(fn, server, rng, count, reps, dask_options)),
                lambda count: f"{count} clients",
            )
        _lines(
            case,
            "linear model",
            case.rows,
            counts,
            (FN_API, DASK),
            "bundles of 256 clients per segment call",
        )
        # A fresh cluster: the CNN's first call on Dask includes its workers' first imports.
        with _dask_cluster() as (dask_options, started_s):
            _cnn_rows(case, cnn_counts, reps, dask_options)
        case.notes.append(
            f"CNN rows: a fresh LocalCluster of 2 worker processes, started in {started_s:.1f} s "
            "(not in any row); one bundle per worker (ceil(clients / 2) clients)."
        )
    return case


def _lines(
    case: report.CaseResult,
    model: str,
    rows: list[dict[str, Any]],
    counts: Sequence[int],
    names: Sequence[str],
    detail: str,
) -> None:
    """A note per alternative: the least-squares line (fixed + per-client cost) through the
    rows' medians, when there are 2 or more client counts."""
    import numpy as np

    if len(counts) < 2:
        return
    for name in names:
        medians = [row["alternatives"][name]["median_s"] for row in rows]
        per_client, fixed = np.polyfit(np.asarray(counts, float), np.asarray(medians), 1)
        case.notes.append(
            f"{model}, {name}: fixed cost {fixed:.2f} s, {1e3 * per_client:.3f} ms per client "
            f"(least-squares line through the medians); {detail}."
        )


def _load_example() -> Any:
    """examples/fedavg_beam.py as a module (its round, initial model and constants), loaded
    once per process (registered in sys.modules, which its dataclasses need)."""
    name = "benchmarks_fedavg_beam_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _cnn_rows(case: report.CaseResult, counts: Sequence[int], reps: int, dask_options: Any) -> None:
    """The CNN's rows: a first-call row at the first count, interleaved rounds at each count,
    and the least-squares lines of jit, the FnApiRunner and Dask."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bridge_mr
    import bridge_mr.beam

    example = _load_example()
    rng = np.random.default_rng(1)
    server = example.init(1)
    runners = {FN_API: None, DASK: dask_options}
    # One function object per alternative: nothing traced for one serves another.
    rounds = {name: example.make_round(local_steps=5) for name in ("jit", *runners)}
    rows: list[dict[str, Any]] = []
    for index, count in enumerate(counts):
        side = example.SIDE
        records = [
            (
                {
                    "x": rng.uniform(size=(example.PER_CLIENT, side, side, 1)).astype(np.float32),
                    "y": rng.integers(0, 10, size=example.PER_CLIENT).astype(np.int32),
                },
                np.float32(example.PER_CLIENT),
            )
            for _ in range(count)
        ]
        stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *records)
        jitted = jax.jit(bridge_mr.program(placements={"clients": count})(rounds["jit"]))
        bundle = -(-count // 2)

        def beam_call(name: str, options: Any, bundle: int = bundle, records: Any = records) -> Any:
            return lambda: bridge_mr.beam.run(
                rounds[name], (server,), records, pipeline_options=options, bundle_size=bundle
            )

        calls = {
            "jit": lambda jitted=jitted, stacked=stacked: harness.sync(jitted(server, *stacked)),
            **{name: beam_call(name, options) for name, options in runners.items()},
        }
        params = {"clients": count, "model": "cnn", "bundle_size": bundle, "local_steps": 5}
        if index == 0:
            first: dict[str, float] = {}
            load = os.getloadavg()[0]
            for name, call in calls.items():
                bridge_mr.clear_caches()
                first[name] = harness.time_once(call)[0]
            once = harness.Comparison("jit", {n: harness.Timing([s], 1) for n, s in first.items()})
            row = report.comparison_row(once, f"beam-cnn/c{count} first call", params)
            row["load_1min"] = [load]
            case.rows.append(row)
        # Untimed: jit's compilation for this count (again at the first: the caches were
        # cleared after its first call), each runner's plan and the segments compiled for this
        # bundle size (twice on Dask: a worker compiles when it first gets a bundle, and either
        # may get either).
        for name in ("jit", FN_API, DASK, DASK):
            calls[name]()
        measured = harness.rounds(
            {name: lambda call=call: call for name, call in calls.items()}, max(reps, 3)
        )
        comparison = harness.Comparison(
            "jit", {n: harness.Timing(s, 1) for n, s in measured.seconds.items()}
        )
        row = report.comparison_row(
            comparison, f"beam-cnn/c{count}", params, metrics={"client_updates_per_s": count}
        )
        row["load_1min"] = measured.load_1min
        rows.append(row)
        case.rows.append(row)
    _lines(case, "CNN", rows, counts, ("jit", FN_API, DASK), "one bundle per Dask worker")
    loads = [x for row in rows for x in row["load_1min"]]
    case.notes.append(
        f"CNN rows: 1-minute load average at the start of each timed round "
        f"{min(loads):.2f}-{max(loads):.2f} (2 CPUs)."
    )


@contextlib.contextmanager
def _dask_cluster() -> Iterator[tuple[Any, float]]:
    """Beam options for a dask.distributed LocalCluster of 2 worker processes (2 threads each),
    and the seconds the cluster took to start."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from dask.distributed import LocalCluster

    start = time.perf_counter()
    # Not `with LocalCluster(...) as cluster`: its __enter__ is typed as sync-or-async.
    cluster = LocalCluster(
        n_workers=2, processes=True, threads_per_worker=2, dashboard_address=":0"
    )
    with cluster:
        started_s = time.perf_counter() - start
        options = PipelineOptions(
            [
                "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                f"--dask_client_address={cluster.scheduler_address}",
            ]
        )
        yield options, started_s
