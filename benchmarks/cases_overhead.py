"""Case 2: what the torch bridge costs on top of the same JAX program, and against pure torch.

The contestants come from `benchmarks.bench_overhead` (the torch frontend's own overhead
benchmark): `map_reduce` FedSGD forward+backward against `jax.jit(jax.value_and_grad(...))` of
the same `jax_core` program and a pure-torch loop; `torch_function` of an MLP forward+backward
against the pure-JAX pair of jitted calls (forward with VJP, then the VJP); and
torch's own floor for one such autograd node (it computes nothing). This case adds a pure-torch
MLP of the same shape and times everything with the interleaved harness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import harness, report
from .environment import LoadMeter


def _pure_torch_mlp(width: int, batch: int) -> Callable[[], Any]:
    """bench_overhead's MLP (tanh hidden layer, one output) forward+backward in pure torch."""
    import torch

    from . import bench_overhead

    params_np, data_np = bench_overhead.make_case(1, width, batch)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in params_np.items()}
    x = torch.tensor(data_np["x"][0])
    cotangent = torch.ones(batch, 1)

    def pure_torch() -> None:
        for p in params.values():
            p.grad = None
        out = torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        out.backward(cotangent)

    return pure_torch


def _named(contestants: dict[str, Any], prefix: str) -> str:
    return next(name for name in contestants if name.startswith(prefix))


def run(ctx: harness.Context) -> report.CaseResult:
    """Case 2."""
    meter = LoadMeter()
    case = report.CaseResult(
        name="overhead",
        title="Bridge overhead: forward+backward through bridge_mr vs pure JAX vs pure torch",
        unit="time per forward+backward; (x) = ratio to pure JAX",
    )
    try:
        from . import bench_overhead
    except ImportError as err:
        case.notes.append(f"Not run: benchmarks.bench_overhead cannot be imported ({err}).")
        return case
    rows = [
        # (row id, params, contestants, targets as (reference prefix, threshold)).
        (
            "map_reduce fedsgd tiny",
            {"clients": 4, "width": 8, "batch": 16},
            lambda: bench_overhead.fedsgd_contestants(4, 8, 16, torch_loop=True),
            [("pure JAX", 2.5), ("pure torch", 1.0)],
        ),
        (
            "map_reduce fedsgd medium",
            {"clients": 64, "width": 256, "batch": 32},
            lambda: bench_overhead.fedsgd_contestants(64, 256, 32, torch_loop=True),
            [("pure JAX", 1.10)],
        ),
        (
            "torch_function mlp tiny",
            {"width": 8, "batch": 16},
            lambda: {
                **bench_overhead.torch_function_contestants(8, 16),
                "pure torch": _pure_torch_mlp(8, 16),
            },
            [("pure JAX", 2.5)],
        ),
        (
            "torch_function mlp 1024-wide",
            {"width": 1024, "batch": 64},
            lambda: {
                **bench_overhead.torch_function_contestants(1024, 64),
                "pure torch": _pure_torch_mlp(1024, 64),
            },
            [],
        ),
    ]
    with harness.progress(len(rows), "overhead") as bar:
        for row_id, params, make, targets in rows:
            bar.set_postfix_str(row_id)
            contestants = make()
            comparison = harness.compare(
                contestants, baseline=_named(contestants, "pure JAX"), policy=ctx.policy
            )
            row = report.comparison_row(comparison, row_id, params)
            case.rows.append(row)
            bridge = _named(contestants, "bridge")
            for prefix, threshold in targets:
                reference = _named(contestants, prefix)
                ratio = comparison.ratio(bridge, reference)
                case.targets.append(
                    report.target(
                        "overhead",
                        row_id,
                        f"{bridge} time / {reference} time",
                        None if ratio is None else ratio["median"],
                        threshold,
                        "<=",
                        report.versus(row, bridge, reference),
                    )
                )
            bar.update()
    case.notes.append(
        "map_reduce rows: forward+backward only (no optimizer step); bridge_mr and the torch "
        "loop leave gradients in .grad, pure JAX returns them. Targets from the torch_api issue."
    )
    case.notes.append(
        "torch autograd floor: one custom autograd node with the bridge's inputs and outputs "
        "that only allocates its results; floor + pure JAX bounds any bridge from below."
    )
    case.load = meter.read()
    return case
