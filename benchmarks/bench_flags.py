"""The YNN fusion flag's effect on JAX's side of the rounds: one child process per setting.

    python -m benchmarks.bench_flags [--settings NAME ...] [--passes N] [--rows NAME ...]

`bridge_mr.recommended_xla_flags()` adds `--xla_cpu_experimental_ynn_fusion_type=-reduce`
(jax-ml/jax#37465). XLA reads XLA_FLAGS once per process, so each setting runs in its own fresh
child process (`--child`), which times the JAX alternatives of each row through
`harness.compare` (quick policy); the settings run one after another, `--passes` times in
turn (A B C A B C ...), and the table shows, per row and alternative, the median over passes
of each child's median, and its ratio to the "recommended" one. torch alternatives are left
out: XLA_FLAGS does not reach them.

Settings: "recommended" (`=-reduce`, what recommended_xla_flags adds), "unset" (no YNN flag:
jaxlib's default fusions), "empty" (`--xla_cpu_experimental_ynn_fusion_type=`: no YNN fusion
type at all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from . import harness
from .environment import LoadMeter

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
SETTINGS = {"recommended": f"{FLAG}=-reduce", "unset": "", "empty": f"{FLAG}="}

#: Row -> the JAX alternatives timed in it.
#: Pure-JAX alternatives only (drjax: the vmapped round in one jit; xla_per_client: the
#: single-client program per client): the flag acts on XLA, and they do not move with
#: bridge_mr's own changes.
ROWS: dict[str, tuple[str, ...]] = {
    "cnn grad b10": ("jax.grad (jit)",),
    "fedavg/cnn/c8": ("xla_per_client", "drjax"),
    "fedavg/lm/c4": ("xla_per_client", "drjax"),
    "fedsgd/small/c64": ("drjax",),
    "fedsgd/medium/c8": ("drjax",),
    "fedavg/small/c64": ("drjax",),
    "fedavg/medium/c8": ("drjax",),
}


def _alternatives(row: str) -> dict[str, Callable[[], Any] | str]:
    from . import workloads

    if row == "cnn grad b10":
        import jax
        import jax.numpy as jnp

        cfg = workloads.round_config("cnn", 1)
        params = {
            n: jnp.asarray(p.detach().numpy())
            for n, p in workloads.round_torch_model(cfg).named_parameters()
        }
        x, y = workloads.round_data(cfg)
        batch = (jnp.asarray(x[0, 0]), jnp.asarray(y[0, 0]))
        grad = jax.jit(jax.grad(workloads.round_jax_loss("cnn")))
        return {"jax.grad (jit)": lambda: grad(params, batch)}
    algo, model, clients = row.split("/")
    count = int(clients.removeprefix("c"))
    if model in ("cnn", "lm"):
        cfg: Any = workloads.round_config(model, count)
    else:
        cfg = workloads.FedConfig(algo, model, count)
    return {name: workloads.build(name, cfg) for name in ROWS[row]}


def child(rows: list[str]) -> dict[str, dict[str, float | str]]:
    """Per row and alternative: median seconds per call (or the error), in this process."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    out: dict[str, dict[str, float | str]] = {}
    for row in rows:
        comparison = harness.compare(
            _alternatives(row), baseline=ROWS[row][0], policy=harness.QUICK
        )
        out[row] = {
            name: comparison.median(name) if comparison.ok(name) else str(timing.error)
            for name, timing in comparison.timings.items()
        }
    return out


def _run_child(setting: str, rows: list[str]) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": SETTINGS[setting]}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_flags", "--child", *rows],
        cwd=harness.PACKAGE_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return {"error": f"child exited with {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    """Runs the settings' children and prints the table; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_flags")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
        return 0
    meter = LoadMeter()
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in args.settings}
    for index in range(args.passes):
        for setting in args.settings:
            print(f"pass {index + 1}: {setting} ({SETTINGS[setting]!r}) ...", file=sys.stderr)
            results[setting].append(_run_child(setting, args.rows))
    load = meter.read()
    print("| row | alternative | " + " | ".join(f"`{s}`" for s in args.settings) + " |")
    print("|---|---|" + "---|" * len(args.settings))
    for row in args.rows:
        for name in ROWS[row]:
            medians = {}
            for setting in args.settings:
                values = [
                    r[row][name]
                    for r in results[setting]
                    if isinstance(r.get(row, {}).get(name), float)
                ]
                medians[setting] = statistics.median(values) if values else None
            reference = medians.get("recommended")
            cells = []
            for setting in args.settings:
                value = medians[setting]
                if value is None:
                    cells.append("n/a")
                    continue
                text = f"{value * 1e3:.1f} ms"
                if reference and setting != "recommended":
                    text += f" ({value / reference:.2f}x)"
                cells.append(text)
            print(f"| {row} | {name} | " + " | ".join(cells) + " |")
    busy, wall = load["other_cpus_busy"], load["wall_s"]
    print(f"\nOther processes kept {busy:.2f} CPUs busy on average ({wall:.0f} s).")
    print(json.dumps({"settings": SETTINGS, "results": results, "load": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
