"""Case 2: what the torch bridge costs on top of the same JAX program, and against pure torch.

The contestants come from `workloads`: `map_reduce` FedSGD forward+backward against
`jax.jit(jax.value_and_grad(...))` of the same `jax_core` program and a pure-torch loop;
`torch_function` of an MLP forward+backward against the pure-JAX pair of jitted calls (forward
with VJP, then the VJP) and pure torch; and torch's own floor for one such autograd node (it
computes nothing), alone and with the pure JAX call inside it: the least any bridge does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .. import harness, report, workloads


class Row(NamedTuple):
    """One row of the case.

    Attributes:
      row_id: the row's name.
      params: its configuration.
      make: its contestants on a device ("cpu" or "cuda").
      targets: ratio targets, as (reference name prefix, threshold).
      own_share: whether the row carries the own-share target (`OWN_SHARE_US`).
    """

    row_id: str
    params: dict[str, int]
    make: Callable[[str], dict[str, Any]]
    targets: list[tuple[str, float]]
    own_share: bool = False


ROWS: list[Row] = [
    Row(
        "map_reduce fedsgd tiny",
        {"clients": 4, "width": 8, "batch": 16},
        lambda device: workloads.map_reduce_contestants(4, 8, 16, device),
        [("pure JAX", 2.5), ("pure torch", 1.0)],
        own_share=True,
    ),
    Row(
        "map_reduce fedsgd medium",
        {"clients": 64, "width": 256, "batch": 32},
        lambda device: workloads.map_reduce_contestants(64, 256, 32, device),
        [("pure JAX", 1.10)],
    ),
    Row(
        "torch_function mlp tiny",
        {"width": 8, "batch": 16},
        lambda device: workloads.torch_function_contestants(8, 16, device),
        [("pure JAX", 2.5)],
    ),
    Row(
        "torch_function mlp 1024-wide",
        {"width": 1024, "batch": 64},
        lambda device: workloads.torch_function_contestants(1024, 64, device),
        [],
    ),
]


def _named(contestants: dict[str, Any], prefix: str) -> str:
    return next(name for name in contestants if name.startswith(prefix))


def _lower_bound(
    comparison: harness.Comparison, row: dict[str, Any], bridge: str, jax_name: str
) -> str | None:
    """A note: the bridge's own cost above floor + pure JAX, measured apart (the difference of
    medians) and in one call (paired per repetition, as `own_share_target` reports it)."""
    medians = {name: entry.get("median_s") for name, entry in row["alternatives"].items()}
    floor, pure, ours = medians.get("torch autograd floor"), medians[jax_name], medians[bridge]
    if floor is None or pure is None or ours is None:
        return None
    apart = floor + pure
    note = (
        f"{row['id']}: {bridge} costs {report.format_time(ours - apart)} above floor + "
        f"{jax_name} measured apart ({report.format_time(apart)})"
    )
    together = medians.get(_TOGETHER)
    difference = comparison.difference(bridge, _TOGETHER)
    if together is None or difference is None:
        return note + "."
    return note + (
        f", {report.format_time(difference['median'])} above the two in one call "
        f"({report.format_time(together)}; median of the per-repetition differences)."
    )


_TOGETHER = "floor + pure JAX in one call"

#: The accelerator issue's per-call target: the bridge's own share of the tiny `map_reduce`
#: call (its time above floor + pure JAX in one call), in microseconds, by device.
OWN_SHARE_US = {"cpu": 40.0, "cuda": 150.0}


def own_share_target(
    comparison: harness.Comparison, row: dict[str, Any], bridge: str, device: str
) -> dict[str, Any]:
    """The target on the bridge's own share of `row`: its time above floor + pure JAX in one
    call, the median over repetitions of the two measured back to back, in microseconds."""
    difference = comparison.difference(bridge, _TOGETHER)
    value = None if difference is None else difference["median"] * 1e6
    return report.target(
        "overhead",
        row["id"],
        f"{bridge}'s own share (µs above {_TOGETHER})",
        value,
        OWN_SHARE_US[device],
        "<=",
        report.versus(row, bridge, _TOGETHER),
    )


def _row(ctx: harness.Context, case: report.CaseResult, spec: Row) -> None:
    """One of `ROWS`: its comparison, its targets, and the lower-bound note."""
    contestants = spec.make(ctx.device)
    jax_name = _named(contestants, "pure JAX")
    comparison = harness.compare(contestants, baseline=jax_name, policy=ctx.policy)
    row = report.comparison_row(comparison, spec.row_id, {**spec.params, "device": ctx.device})
    case.rows.append(row)
    bridge = _named(contestants, "bridge")
    for prefix, threshold in spec.targets:
        reference = _named(contestants, prefix)
        case.targets.append(
            report.paired_target(
                "overhead",
                row,
                f"{bridge} time / {reference} time",
                comparison.ratio(bridge, reference),
                threshold,
                "<=",
                (bridge, reference),
            )
        )
    if spec.own_share:
        case.targets.append(own_share_target(comparison, row, bridge, ctx.device))
    bound = _lower_bound(comparison, row, bridge, jax_name)
    if bound is not None:
        case.notes.append(bound)


def run(ctx: harness.Context) -> report.CaseResult:
    """Case 2."""
    title = "Bridge overhead: forward+backward through bridge_mr vs pure JAX vs pure torch"
    with report.case_result(
        "overhead", title, "time per forward+backward; (x) = ratio to pure JAX"
    ) as case:
        case.notes.append(
            "map_reduce rows: forward+backward only (no optimizer step); bridge_mr and the "
            "torch loop leave gradients in .grad, pure JAX returns them. Ratio targets from "
            "the torch_api issue; the own share's (at most 40 µs on CPU, 150 µs on CUDA) from "
            "the accelerator issue."
        )
        case.notes.append(
            "torch autograd floor: one custom autograd node with the bridge's inputs and "
            "outputs that only allocates its results. floor + pure JAX in one call: that node "
            "with the pure JAX call between its forward and backward, the least any bridge "
            "does; on a small machine's caches it costs more than the two measured apart. The "
            "bridge's own share is its time above it."
        )
        harness.each(ROWS, "overhead", lambda spec: _row(ctx, case, spec))
    return case
