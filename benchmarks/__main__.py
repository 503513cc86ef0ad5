"""bridge_mr benchmark suite: throughput, overhead and memory against the alternatives.

    python -m benchmarks [--quick] [--cases NAME ...] [--out DIR] (see --help for filters)
    python -m benchmarks --cases accelerator --device cuda   (issue 31's rows on a GPU)
    python -m benchmarks --cases overhead --device cuda      (the cost of one call on a GPU)
    python -m benchmarks --cases accelerator --device tpu --precision highest medium  (issue 41)

Prints a table per case and the targets, and writes results.json, results.md and PNG plots to
--out (default benchmarks/results, or benchmarks/results/quick with --quick). Run from the
repository root. No XLA flag is set: bridge_mr chooses XLA's CPU options per program
(`bridge_mr.jax_core.cpu_compiler_options`); the XLA_FLAGS a run had are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from . import environment, harness, report, workloads
from .cases import (
    accelerator,
    beam,
    boundary,
    data,
    diloco,
    federated,
    from_torch,
    limits,
    models,
    overhead,
    processes,
    recurrent,
    users_path,
)
from .workloads import accelerator as accelerator_rows
from .workloads import users

XLA_FLAGS = os.environ.get("XLA_FLAGS", "")  # As the user set them: bridge_mr sets none.

CASES: dict[str, Callable[[harness.Context], report.CaseResult]] = {
    "boundary": boundary.run,
    "overhead": overhead.run,
    "fedsgd": lambda ctx: federated.run_rounds(ctx, "fedsgd"),
    "fedavg": lambda ctx: federated.run_rounds(ctx, "fedavg"),
    "scaling": federated.run_scaling,
    "limits": limits.run,
    "cnn": lambda ctx: models.run(ctx, "cnn"),
    "lm": lambda ctx: models.run(ctx, "lm"),
    "from_torch": from_torch.run,
    "processes": processes.run,
    "diloco": diloco.run,
    "beam": beam.run,
    "users_path": users_path.run,
    "data": data.run,
    "recurrent": recurrent.run,
    "accelerator": accelerator.run,
}
#: Cases run only when asked for by name (`--cases`), not by default.
OPT_IN = ("accelerator",)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, ~2 minutes")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASES),
        default=[c for c in CASES if c not in OPT_IN],
        metavar="NAME",
        help=f"cases to run (default: all of {', '.join(c for c in CASES if c not in OPT_IN)}; "
        f"also {', '.join(OPT_IN)})",
    )
    parser.add_argument("--out", help="output folder (default benchmarks/results[/quick])")
    parser.add_argument(
        "--reps",
        type=int,
        help="repetitions per comparison (overrides mode); accelerator: later rounds",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "tpu"],
        default="cpu",
        help="accelerator and overhead cases: where the tensors live (cuda: torch's and JAX's "
        "CUDA devices; tpu, accelerator case only: host tensors, JAX's programs on the chip)",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=["highest", "high", "medium"],
        default=["highest"],
        help="accelerator case: torch.set_float32_matmul_precision for each row (pure JAX: the "
        "same JAX precision)",
    )
    parser.add_argument(
        "--memory",
        choices=["auto", "all", "none"],
        default="auto",
        help="peak-RSS child processes: the rows each case picks (auto), all rows, or none",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(dict.fromkeys([*workloads.MODELS, *users.MODELS, *accelerator_rows.MODELS])),
        help=f"federated cases: models; users_path: of {', '.join(users.MODELS)}; "
        f"accelerator: of {', '.join(accelerator_rows.MODELS)}",
    )
    parser.add_argument(
        "--clients", nargs="+", type=int, metavar="N", help="federated cases: client counts"
    )
    parser.add_argument(
        "--alternatives",
        nargs="+",
        choices=list(
            dict.fromkeys(
                workloads.ALTERNATIVES
                + workloads.round_alternatives()
                + users_path.DEFAULT_ALTERNATIVES
                + accelerator_rows.ALTERNATIVES
            )
        ),
        metavar="NAME",
        help=f"federated cases: alternatives (default: {', '.join(workloads.ALTERNATIVES)}); "
        f"cnn and lm: of {', '.join(workloads.round_alternatives())} (default: all); "
        f"users_path: of {', '.join(users_path.DEFAULT_ALTERNATIVES)} and "
        "bridge_mr:STRATEGY (default: those); accelerator: of "
        f"{', '.join(accelerator_rows.ALTERNATIVES)} (default: all)",
    )
    parser.add_argument("--no-xla", action="store_true", help="skip the torch-xla rows")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--sync-dispatch",
        action="store_true",
        help="run JAX CPU computations on the calling thread (jax_cpu_enable_async_dispatch="
        "False): no thread handoff per call",
    )
    return parser.parse_args(argv)


def _markdown(document: dict[str, Any], cases: list[report.CaseResult], plots: list[str]) -> str:
    load = document["load"]
    lines = [
        "# bridge_mr benchmark results",
        "",
        f"Command: `{document['command']}` ({document['mode']} run), started "
        f"{document['started']}, {document['duration_s']:.0f} s.",
        "",
        "```",
        environment.describe(document["machine"]),
        f"other processes kept {load['other_cpus_busy']:.2f} CPUs busy on average during the run"
        if load.get("other_cpus_busy") is not None
        else "load of other processes: unknown",
        "```",
        "",
        "Method: warm-up excluded; alternatives interleaved (A B C, B C A, ...) in one process; "
        "cells show the median over repetitions ±half the interquartile range, and (x) the "
        "median of per-repetition ratios to the row's baseline. Every call is synced before "
        "the clock stops. Peak RSS: ru_maxrss of a fresh process that builds and runs only "
        "that round, once.",
        "",
    ]
    lines.append(report.targets_markdown(document["targets"]))
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plots]
    for case in cases:
        lines.append(report.case_markdown(case))
    return "\n".join(lines)


def _cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here (torch or JAX without a CUDA device), or None."""
    import jax
    import torch

    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is "
            "False). Fix: run on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    try:
        jax.devices("cuda")
    except RuntimeError as err:
        return (
            f"JAX {jax.__version__} has no CUDA backend ({err}). Fix: pip install "
            '"jax[cuda13]" (the CUDA major version of your torch build), see the README.'
        )
    return None


def _tpu_missing() -> str | None:
    """Why `--device tpu` cannot run here (JAX's default backend is not a TPU), or None. Asked
    in a short process: this one must leave the chip to the workers."""
    probe = "import jax; print(jax.devices()[0].platform)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    platform = done.stdout.strip()
    if platform == "tpu":
        return None
    return (
        f"JAX's default backend is {platform or 'unavailable'!r}, not a TPU "
        f"({done.stderr.strip().splitlines()[-1:] or 'no error'}). Fix: run on a TPU host with "
        "jax[tpu] installed and JAX_PLATFORMS unset."
    )


def main(argv: list[str]) -> int:
    """Runs the selected cases and writes the results; returns the exit status."""
    args = _parse(argv)
    if args.device == "cuda":
        missing = _cuda_missing()
        if missing:
            print(f"python -m benchmarks --device cuda: {missing}", file=sys.stderr)
            return 2
    if args.device == "tpu":
        if set(args.cases) != {"accelerator"}:
            print(
                "python -m benchmarks --device tpu: runs the accelerator case only "
                "(--cases accelerator)",
                file=sys.stderr,
            )
            return 2
        missing = _tpu_missing()
        if missing:
            print(f"python -m benchmarks --device tpu: {missing}", file=sys.stderr)
            return 2
        import jax

        # This process describes the machine with JAX's CPU backend; the chip is the workers'.
        jax.config.update("jax_platforms", "cpu")
    logging.getLogger("absl").setLevel(logging.ERROR)  # drjax logs per trace without a mesh.
    if args.sync_dispatch:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)  # Before the backend starts.
    policy = harness.QUICK if args.quick else harness.FULL
    if args.reps is not None:
        policy = harness.TimingPolicy(
            reps=args.reps,
            min_reps=min(args.reps, policy.min_reps),
            warmup=policy.warmup,
            min_sample_s=policy.min_sample_s,
            budget_s=policy.budget_s,
        )
    chosen = args.alternatives or workloads.ALTERNATIVES
    ctx = harness.Context(
        quick=args.quick,
        policy=policy,
        alternatives=tuple(a for a in chosen if a in workloads.ALTERNATIVES)
        or workloads.ALTERNATIVES,
        round_alternatives=tuple(args.alternatives) if args.alternatives else None,
        memory=args.memory,
        models=tuple(args.models) if args.models else None,
        clients=tuple(args.clients) if args.clients else None,
        xla=not args.no_xla,
        device=args.device,
        rounds=args.reps,
        precisions=tuple(dict.fromkeys(args.precision)),
    )
    out_dir = args.out or os.path.join(
        harness.PACKAGE_ROOT, "benchmarks", "results", *(["quick"] if args.quick else [])
    )
    os.makedirs(out_dir, exist_ok=True)

    machine = environment.machine()
    command = "python -m benchmarks " + shlex.join(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"{command.strip()}  ({'quick' if args.quick else 'full'} run, started {started})")
    print(environment.describe(machine), flush=True)
    meter = environment.LoadMeter()
    results: list[report.CaseResult] = []
    for name in args.cases:
        case = CASES[name](ctx)
        results.append(case)
        print("\n" + report.case_markdown(case), flush=True)
    targets = [t for case in results for t in case.targets]
    run_load = meter.read()
    document = {
        "schema": report.SCHEMA,
        "command": command.strip(),
        "mode": "quick" if args.quick else "full",
        "started": started,
        "duration_s": run_load["wall_s"],
        "machine": machine,
        "load": run_load,
        "policy": {**dataclasses.asdict(policy), "memory": ctx.memory},
        "cases": {case.name: case.as_json() for case in results},
        "targets": targets,
    }
    plots: list[str] = []
    if not args.no_plots:
        from . import plots as plotting

        plots = plotting.write_plots(document, out_dir)
    report.write_json(os.path.join(out_dir, "results.json"), document)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(_markdown(document, results, plots))
    print("\n" + report.targets_markdown(targets))
    load = document["load"]["other_cpus_busy"]
    if load is not None:
        print(f"Other processes kept {load:.2f} CPUs busy on average during this run.")
    print(
        f"Wrote {out_dir}/results.json, results.md and {len(plots)} plots "
        f"({document['duration_s']:.0f} s)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
