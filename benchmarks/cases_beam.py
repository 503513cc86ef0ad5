"""Case "beam": a FedAvg round on Apache Beam (in-process, and on Dask) against jit.

`bridge_mr.beam.run` of a FedAvg round (3 local SGD steps of a linear model per client, a
weighted mean) for 16 to 10,000 clients (quick: 16 to 2,048) on the FnApiRunner (the engine of
Beam's DirectRunner for batch pipelines), and `jax.jit` of the same program on the stacked
records, and the same Beam pipeline on Beam's DaskRunner over a dask.distributed LocalCluster of
2 worker processes; the three alternatives interleaved round by round, the load average beside
each round. Fixed and per-client cost come from a least-squares line through each runner's times;
an untimed run first makes the plan, its self-test and the compilations (once per program and
bundle size in a worker process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import harness, report

FN_API = "beam FnApiRunner"
DASK = "beam DaskRunner (2 workers)"

DIM, EXAMPLES = 32, 16


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
    """The beam case."""
    import numpy as np

    counts = ctx.clients or ((16, 256, 2048) if ctx.quick else (16, 100, 1000, 10000))
    reps = 2 if ctx.quick else 3
    fn = _program()
    rng = np.random.default_rng(0)
    server = {"w": np.zeros(DIM, np.float32), "b": np.float32(0.0)}
    title = "A FedAvg round on Beam (FnApiRunner; DaskRunner, 2 workers) vs the same round in jit"
    unit = "seconds per round; (x) = ratio to jit; upd/s = client updates per second"
    with report.case_result("beam", title, unit) as case, _dask_cluster() as dask_options:
        harness.each(
            counts,
            "beam",
            lambda count: case.rows.append(_row(fn, server, rng, count, reps, dask_options)),
            lambda count: f"{count} clients",
        )
        if len(counts) >= 2:
            for name in (FN_API, DASK):
                medians = [row["alternatives"][name]["median_s"] for row in case.rows]
                per_client, fixed = np.polyfit(np.asarray(counts, float), np.asarray(medians), 1)
                case.notes.append(
                    f"{name}: fixed cost {fixed:.2f} s, {1e3 * per_client:.3f} ms per client "
                    "(least-squares line through the medians); bundles of 256 clients per "
                    "segment call."
                )
    return case


@contextlib.contextmanager
def _dask_cluster() -> Iterator[Any]:
    """Beam options for a dask.distributed LocalCluster of 2 worker processes (2 threads each)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from dask.distributed import LocalCluster

    with LocalCluster(
        n_workers=2, processes=True, threads_per_worker=2, dashboard_address=":0"
    ) as cluster:
        yield PipelineOptions(
            [
                "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                f"--dask_client_address={cluster.scheduler_address}",
            ]
        )
