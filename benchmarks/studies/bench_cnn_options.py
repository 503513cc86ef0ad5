"""XLA:CPU's options for the CNN round's per-client convolutions, compared in one process.

    python -m benchmarks.studies.bench_cnn_options [--clients N] [--reps N] [--variants NAME ...]

The program is the documented CNN round (`workloads.users`, "cnn": pfl-research's simple_cnn
written in torch, `from_torch` + `algorithms.local_training(optax.sgd)`) as
`jax_core.map_reduce(..., strategy="per_client")`, the program bridge_mr runs for it. Each
variant compiles that round (or a restructured one) with compiler options on top of the ones
bridge_mr compiles CPU programs with (`jax_core.cpu_compiler_options`: no YNNPACK fusion), and
the variants are timed interleaved (A B C, B C A, ...) with, per timed round, the 1-minute load
average and the CPUs other processes kept busy. Every variant's result is checked against the
baseline's. Variants (`VARIANTS`):

* XLA options: fast math, single-threaded Eigen, XNNPACK, XNNPACK graph fusion, the
  concurrency-optimized scheduler, YNNPACK for convolutions alone, the oneDNN custom calls
  (no effect on this jaxlib's convolutions: no oneDNN call appears in the compiled HLO);
* restructured rounds: K clients per step of the scan over clients, unrolled (not vmapped, so no
  grouped convolutions), so that XLA's thunk runtime may run two clients' convolutions at once
  on the two cores, with and without multi-threaded Eigen.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from .. import harness
from ..environment import LoadMeter

_NO_MT = {"xla_cpu_multi_thread_eigen": False}
#: Variant -> (clients per scan step, unrolled; XLA compiler options added to bridge_mr's).
VARIANTS: dict[str, tuple[int, dict[str, Any]]] = {
    "per_client": (1, {}),
    "fast_math": (1, {"xla_cpu_enable_fast_math": True}),
    "no_mt_eigen": (1, _NO_MT),
    "xnnpack": (1, {"xla_cpu_use_xnnpack": True}),
    "xnn_graph": (
        1,
        {
            "xla_cpu_use_xnnpack": True,
            "xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY",
        },
    ),
    "concurrency_sched": (1, {"xla_cpu_enable_concurrency_optimized_scheduler": True}),
    "ynn_conv": (
        1,
        {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"},
    ),
    "onednn": (
        1,
        {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_custom_call": True},
    ),
    "pair": (2, {}),
    "pair_no_mt": (2, _NO_MT),
    "quad": (4, {}),
    "quad_no_mt": (4, _NO_MT),
}


def _round(per_step: int, clients: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The CNN round with `per_step` clients per scan step (1: map_reduce's per_client) and its
    arguments (JAX arrays)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import bridge_mr
    from bridge_mr import algorithms as alg
    from bridge_mr import jax_core

    from ..workloads import users

    cfg = users.UserConfig("cnn", clients)
    net = users.build_model("cnn")
    local = alg.local_training(
        bridge_mr.from_torch(users.functional_loss("cnn", net)), optax.sgd(cfg.lr), cfg.steps
    )
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in net.named_parameters()}
    data = {
        k: jnp.asarray(v.astype(np.int32) if k == "y" else v) for k, v in users.data(cfg).items()
    }
    if per_step == 1:
        return functools.partial(jax_core.map_reduce, local, strategy="per_client"), (params, data)
    if clients % per_step:
        raise ValueError(f"--clients {clients} is not a multiple of {per_step}")
    client = jax_core.canonical_layouts(local)

    def grouped(server: Any, stacked: Any) -> Any:
        steps = jax.tree.map(lambda a: a.reshape(-1, per_step, *a.shape[1:]), stacked)
        one = jax.tree.map(lambda a: a[0, 0], steps)
        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(client, server, one))

        def step(total: Any, group: Any) -> tuple[Any, None]:
            for i in range(per_step):
                out = client(server, jax.tree.map(lambda a, i=i: a[i], group))
                total = jax.tree.map(jnp.add, total, out)
            return total, None

        total, _ = jax.lax.scan(step, zeros, steps)
        return jax.tree.map(lambda t: t / clients, total)

    return grouped, (params, data)


def _compiled(name: str, clients: int) -> Callable[[], Any] | str:
    import jax

    from bridge_mr import jax_core

    per_step, options = VARIANTS[name]
    fn, args = _round(per_step, clients)
    traced = jax.jit(fn).trace(*args)
    try:
        compiled = traced.lower().compile(
            {**jax_core.cpu_compiler_options(traced.jaxpr), **options}
        )
    except Exception as err:  # An option this jaxlib rejects is a result to report.
        return f"{type(err).__name__}: {err}"
    return functools.partial(compiled, *args)


def _max_difference(a: Any, b: Any) -> float:
    import jax
    import numpy as np

    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)


def main(argv: list[str]) -> int:
    """Compiles, checks and times the variants; prints a table and a JSON line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.bench_cnn_options")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    names = ["per_client", *(v for v in args.variants if v != "per_client")]
    built = {name: _compiled(name, args.clients) for name in names}
    runnable = {n: f for n, f in built.items() if not isinstance(f, str)}
    reference = harness.time_once(runnable["per_client"])[1]
    difference = {
        n: _max_difference(harness.time_once(f)[1], reference) for n, f in runnable.items()
    }
    seconds: dict[str, list[float]] = {n: [] for n in runnable}
    loads: dict[str, list[tuple[float, float | None]]] = {n: [] for n in runnable}
    order = list(runnable)
    for rep in range(args.reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            meter, load_1min = LoadMeter(), os.getloadavg()[0]
            seconds[name].append(harness.time_once(runnable[name])[0])
            loads[name].append((load_1min, meter.read()["other_cpus_busy"]))
    print(f"CNN round, {args.clients} clients, {args.reps} interleaved rounds per variant:")
    print("| variant | median | / per_client (paired) | max abs diff | other CPUs busy (max) |")
    print("|---|---|---|---|---|")
    for name in names:
        if name not in runnable:
            print(f"| {name} | n/a: {built[name]} | | | |")
            continue
        ratios = [a / b for a, b in zip(seconds[name], seconds["per_client"], strict=True)]
        busy = max((o for _, o in loads[name] if o is not None), default=float("nan"))
        print(
            f"| {name} | {statistics.median(seconds[name]):.3f} s | "
            f"{statistics.median(ratios):.3f} | {difference[name]:.2g} | {busy:.2f} |"
        )
    errors = {n: f for n, f in built.items() if isinstance(f, str)}
    print(json.dumps({"seconds": seconds, "loads": loads, "difference": difference, **errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
