"""Case "beam": a FedAvg round on Apache Beam's in-process runner against the same round in jit.

`bridge_mr.beam.run` of a FedAvg round (3 local SGD steps of a linear model per client, a
weighted mean) for 16 to 10,000 clients (quick: 16 to 2,048) on the FnApiRunner (the engine of
Beam's DirectRunner for batch pipelines), and `jax.jit` of the same program on the stacked
records. Fixed cost and per-client cost come from a least-squares line through the Beam times;
an untimed run first makes the plan, its self-test and the compilations (once per program and
bundle size in a worker process).
"""

from __future__ import annotations

from typing import Any

from . import harness, report

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


def _row(fn: Any, server: Any, rng: Any, count: int, reps: int) -> dict[str, Any]:
    """The row of `count` clients: jit of the stacked records, then Beam of the records."""
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
    jit_samples = harness.time_calls(lambda: jitted(server, *stacked), max(reps, 5))
    # Untimed: the plan, its self-test, and the client segment compiled for these bundle sizes
    # (each worker process compiles each size once).
    bridge_mr.beam.run(fn, (server,), records)
    beam_samples = harness.time_calls(lambda: bridge_mr.beam.run(fn, (server,), records), reps)
    jit_entry = harness.Timing(jit_samples, 1).summary()
    beam_entry = harness.Timing(beam_samples, 1).summary()
    beam_entry["ratio_to_baseline"] = {"median": beam_entry["median_s"] / jit_entry["median_s"]}
    for entry in (jit_entry, beam_entry):
        entry["client_updates_per_s"] = count / entry["median_s"]
    return {
        "id": f"beam/c{count}",
        "params": {"clients": count, "dim": DIM, "examples": EXAMPLES},
        "baseline": "jit",
        "alternatives": {"jit": jit_entry, "beam FnApiRunner": beam_entry},
    }


def run(ctx: harness.Context) -> report.CaseResult:
    """The beam case."""
    import numpy as np

    counts = ctx.clients or ((16, 256, 2048) if ctx.quick else (16, 100, 1000, 10000))
    reps = 2 if ctx.quick else 3
    fn = _program()
    rng = np.random.default_rng(0)
    server = {"w": np.zeros(DIM, np.float32), "b": np.float32(0.0)}
    title = "A FedAvg round on Beam (in-process FnApiRunner) vs the same round under jit"
    unit = "seconds per round; (x) = ratio to jit; upd/s = client updates per second"
    with report.case_result("beam", title, unit) as case:
        harness.each(
            counts,
            "beam",
            lambda count: case.rows.append(_row(fn, server, rng, count, reps)),
            lambda count: f"{count} clients",
        )
        if len(counts) >= 2:
            medians = [row["alternatives"]["beam FnApiRunner"]["median_s"] for row in case.rows]
            per_client, fixed = np.polyfit(np.asarray(counts, float), np.asarray(medians), 1)
            case.notes.append(
                f"Beam round: fixed cost {fixed:.2f} s, {1e3 * per_client:.3f} ms per client "
                "(least-squares line through the medians); bundles of 256 clients per segment "
                "call."
            )
    return case
