"""YNNPACK fusion settings, compared per compilation on the programs bridge_mr compiles.

    python -m benchmarks.bench_flags [--settings NAME ...] [--rows NAME ...] [--reps N]

`--xla_cpu_experimental_ynn_fusion_type` (which XLA:CPU fusions go to YNNPACK) is also a
per-compilation option (`compile(compiler_options={...})`), so every setting compiles the same
lowered program in this one process and `harness.compare` times them interleaved, which cancels
the machine's load drift between settings. The process itself runs with
`recommended_xla_flags()` (`-reduce`), the "flags" column; the table gives each setting's median
and its paired ratio to "flags". The rows are pure-JAX programs through `jax_core.map_reduce`
(bridge_mr's own programs, without the torch side, which the flag does not reach).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from . import harness
from .environment import LoadMeter

OPTION = "xla_cpu_experimental_ynn_fusion_type"
_DOT, _ELTWISE = "LIBRARY_FUSION_TYPE_DOT", "LIBRARY_FUSION_TYPE_ELTWISE"

#: Setting -> the option's value (None: the process's XLA_FLAGS, as `recommended_xla_flags()`).
SETTINGS: dict[str, str | None] = {
    "flags": None,
    "none": "",
    "dot+eltwise": f"{_DOT},{_ELTWISE}",
    "dot": _DOT,
    "individual_dot": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "individual_conv": "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION",
}

#: Row -> (model, algorithm, clients, strategy).
ROWS: dict[str, tuple[str, str, int, str]] = {
    "cnn fedavg c8 per_client": ("cnn", "fedavg", 8, "per_client"),
    "cnn fedavg c8 vmap": ("cnn", "fedavg", 8, "vmap"),
    "lm fedavg c4 per_client": ("lm", "fedavg", 4, "per_client"),
    "small fedsgd c64 vmap": ("small", "fedsgd", 64, "vmap"),
    "medium fedsgd c64 vmap": ("medium", "fedsgd", 64, "vmap"),
    "medium fedsgd c64 chunks": ("medium", "fedsgd", 64, "chunks"),
    "small fedavg c64 vmap": ("small", "fedavg", 64, "vmap"),
    "medium fedavg c8 vmap": ("medium", "fedavg", 8, "vmap"),
    "medium fedavg c8 chunks": ("medium", "fedavg", 8, "chunks"),
}
CHUNK_SIZE = 16


def _program(row: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The row's round as a JAX function and its arguments."""
    import jax
    import jax.numpy as jnp

    from bridge_mr import jax_core

    from . import workloads

    model, algo, clients, strategy = ROWS[row]
    chunks = {"chunk_size": CHUNK_SIZE} if strategy == "chunks" else {}
    if model in ("cnn", "lm"):
        cfg = workloads.round_config(model, clients)
        params, data = workloads.round_jax_state(cfg)
        update = workloads.round_client_update(cfg)
        return functools.partial(jax_core.map_reduce, update, strategy=strategy, **chunks), (
            params,
            data,
        )
    fed = workloads.FedConfig(algo, model, clients)
    torch_params = workloads.torch_model(fed.widths).named_parameters()
    params = {name: jnp.asarray(p.detach().numpy()) for name, p in torch_params}
    x, y = workloads.client_data(fed)
    data = (jnp.asarray(x), jnp.asarray(y))
    if algo == "fedsgd":  # One batch per client: the client's data is its batch.

        def mean_loss(p: Any, d: Any) -> Any:
            return jax_core.map_reduce(workloads.jax_loss, p, d, strategy=strategy, **chunks)

        return jax.grad(mean_loss), (params, data)
    update = workloads.client_update(fed)
    return functools.partial(jax_core.map_reduce, update, strategy=strategy, **chunks), (
        params,
        data,
    )


def _alternatives(row: str, settings: list[str]) -> dict[str, Callable[[], Any] | str]:
    import jax

    fn, args = _program(row)
    lowered = jax.jit(fn).lower(*args)
    out: dict[str, Callable[[], Any] | str] = {}
    for setting in settings:
        value = SETTINGS[setting]
        try:
            compiled = lowered.compile() if value is None else lowered.compile({OPTION: value})
        except Exception as err:  # A setting this jaxlib rejects is a result to report.
            out[setting] = f"{type(err).__name__}: {err}"
            continue
        out[setting] = functools.partial(compiled, *args)
    return out


def main(argv: list[str]) -> int:
    """Times every setting on every row and prints the table; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_flags")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--reps", type=int, default=harness.QUICK.reps)
    args = parser.parse_args(argv)
    settings = ["flags", *(s for s in args.settings if s != "flags")]
    policy = harness.TimingPolicy(
        reps=args.reps,
        min_reps=min(args.reps, harness.QUICK.min_reps),
        warmup=1,
        min_sample_s=harness.QUICK.min_sample_s,
        budget_s=harness.QUICK.budget_s,
    )
    meter = LoadMeter()
    results: dict[str, dict[str, dict[str, float] | str]] = {}
    print("| row | " + " | ".join(f"`{s}`" for s in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for row in args.rows:
        comparison = harness.compare(_alternatives(row, settings), baseline="flags", policy=policy)
        cells, results[row] = [], {}
        for setting in settings:
            timing = comparison.timings[setting]
            if not comparison.ok(setting):
                cells.append("n/a")
                results[row][setting] = str(timing.error)
                continue
            median = comparison.median(setting)
            ratio = comparison.ratio(setting, "flags")
            results[row][setting] = {"median_s": median, **({"ratio": ratio} if ratio else {})}
            text = f"{median * 1e3:.1f} ms"
            if ratio is not None and setting != "flags":
                text += f" ({ratio['median']:.2f}x)"
            cells.append(text)
        print(f"| {row} | " + " | ".join(cells) + " |", flush=True)
    load = meter.read()
    busy, wall = load["other_cpus_busy"], load["wall_s"]
    print(f"\nXLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; other processes kept {busy:.2f} CPUs")
    print(f"busy on average ({wall:.0f} s).")
    print(json.dumps({"settings": SETTINGS, "results": results, "load": load}))
    return 0


if __name__ == "__main__":
    from .environment import configure

    configure()  # Before JAX starts a backend: recommended_xla_flags().
    sys.exit(main(sys.argv[1:]))
