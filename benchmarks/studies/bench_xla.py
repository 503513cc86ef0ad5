"""Federated rounds on a torch-xla device: bridge_mr against pure torch-xla, side by side.

Run from the repository root in the torch-xla environment:

    PJRT_DEVICE=CPU .venv-xla/bin/python -m benchmarks.studies.bench_xla [--quick] [--algo fedavg]
        [--models small] [--clients 8 64]

The rounds are `workloads`' (`bridge_mr_xla`: `bridge_mr.map_reduce` from torch on the XLA
device, one JAX program embedded in torch-xla's lazy graph; `torch_xla`: `torch.func.vmap` over
`functional_call`, traced op by op into the lazy graph every round), timed by the suite's
harness: `XLA_WARMUP` untimed rounds (the first compiles), then alternatives interleaved, every
round ended by `torch_xla.sync()` and `xm.wait_device_ops()`. Each row records how many graphs
each alternative compiled while it was timed (0: every timed round reused a compiled graph).

`python -m benchmarks` gets its torch-xla rows from here: in its own process where torch_xla
is importable, else from `.venv-xla/bin/python -m benchmarks.studies.bench_xla --spec JSON`, which
prints them as one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

# torch_xla's runtime before any JAX backend: it must own the device (TPU) first.
import torch_xla
import torch_xla.debug.metrics as metrics

from .. import harness, report, workloads
from ..workloads import FedConfig

BASELINE = "torch_xla"
#: Untimed rounds first: the first round compiles, and pure torch-xla sometimes compiles a
#: second graph in a later early round (seen in round 2 and in round 4).
XLA_WARMUP = 3


def _compile_count() -> int:
    """torch-xla's compilations so far in this process (its metric is None before the first)."""
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


class _CompileLedger:
    """torch-xla compilations per alternative during its timed calls (after its warm-up).

    The harness runs one call at a time and syncs it before the next begins, so compilations
    between the start of one call and the start of the next belong to the first.
    """

    def __init__(self, warmup: int) -> None:
        self._warmup = warmup
        self._calls: dict[str, int] = {}
        self._open: tuple[str, int] | None = None
        self.compiles: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """`fn`, counted under `name`."""
        self.compiles[name] = 0

        def call() -> Any:
            self.close()
            self._calls[name] = self._calls.get(name, 0) + 1
            self._open = (name, _compile_count())
            return fn()

        return call

    def close(self) -> None:
        """Books the compilations of the call in progress (call it once timing is done)."""
        if self._open is not None:
            name, start = self._open
            if self._calls[name] > self._warmup:
                self.compiles[name] += _compile_count() - start
            self._open = None


def measure(configs: list[FedConfig], policy: harness.TimingPolicy) -> dict[str, Any]:
    """bridge_mr on torch-xla against pure torch-xla, one interleaved comparison per config.

    Warms up at least `XLA_WARMUP` rounds per alternative, whatever `policy` says.

    Returns:
      {"rows": [row], "torch", "torch_xla", "device", "xla_flags"}; each row's params hold
      the config and "compiles_while_timing" per alternative (0: every timed round reused a
      compiled graph).
    """
    import torch

    policy = dataclasses.replace(policy, warmup=max(policy.warmup, XLA_WARMUP))
    rows = []
    for cfg in configs:
        row_id = f"{cfg.row_id}/xla"
        print(f"  torch-xla {row_id}", file=sys.stderr)
        ledger = _CompileLedger(policy.warmup)
        built = {name: workloads.build(name, cfg) for name in workloads.XLA_ALTERNATIVES}
        counted = {
            name: fn if isinstance(fn, str) else ledger.wrap(name, fn) for name, fn in built.items()
        }
        comparison = harness.compare(counted, baseline=BASELINE, policy=policy)
        ledger.close()
        params = {**cfg.params(), "compiles_while_timing": ledger.compiles}
        rows.append(
            report.comparison_row(
                comparison, row_id, params, metrics={"client_updates_per_s": cfg.clients}
            )
        )
    return {
        "rows": rows,
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "device": str(torch_xla.device()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main(argv: list[str]) -> int:
    """Runs the comparison; prints a table, or with --spec one JSON line. Returns 0."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.bench_xla", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 8 clients")
    parser.add_argument("--algo", choices=["fedsgd", "fedavg"], default="fedavg")
    parser.add_argument("--models", nargs="+", choices=list(workloads.MODELS), default=["small"])
    parser.add_argument("--clients", nargs="+", type=int, metavar="N", help="default: 8 64")
    parser.add_argument("--spec", help="JSON from `python -m benchmarks` (prints JSON)")
    args = parser.parse_args(argv)
    if args.spec is not None:
        spec = json.loads(args.spec)
        configs = [FedConfig(**fields) for fields in spec["configs"]]
        print(json.dumps(measure(configs, harness.TimingPolicy(**spec["policy"]))))
        return 0
    clients = args.clients or ([8] if args.quick else [8, 64])
    configs = [FedConfig(args.algo, model, c) for model in args.models for c in clients]
    result = measure(configs, harness.QUICK if args.quick else harness.FULL)
    compiles = (f"{row['id']} {row['params']['compiles_while_timing']}" for row in result["rows"])
    case = report.CaseResult(
        name="xla",
        title=f"{args.algo} rounds on {result['device']}: bridge_mr vs pure torch-xla",
        unit="time per round; (x) = ratio to torch_xla; client updates/s",
        rows=result["rows"],
        notes=[
            f"torch {result['torch']}, torch_xla {result['torch_xla']}, XLA_FLAGS "
            f"{result['xla_flags']!r}; compilations while timing: " + ", ".join(compiles)
        ],
    )
    print(report.case_markdown(case), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
