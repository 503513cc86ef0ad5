"""Case "data": building a round's client batches, against the round they feed (issue 34).

pfl-research's CIFAR10 shape: every client holds 50 images (NCHW float32 [3, 32, 32]) and
one-hot labels; a round is 5 local steps of batch 10 for every client. Two ways to build the
round's `[clients, 5, 10, ...]` batches are timed, interleaved:

* `bridge_mr.data`: the examples live in a `bridge_mr.data.FederatedDataset` on the round's
  device; `round()` computes every client's example order on the host and gathers once.
* `torch_stack_loop`: what a user writes: per-client tensors on the host, a loop over the
  clients (`torch.randperm`, an index, a view), `torch.stack`, and a copy to the device.

The round itself is the "cnn" case's bridge_mr FedAvg round (`map_reduce`, default strategy)
run on those batches, timed after a first (compiling) call; the target is the batch building
as a fraction of that round's time (<= 5%). On CPU always; on CUDA too where a GPU is at hand.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from .. import harness, report, workloads

#: Client counts: the --quick run, the full run (500 clients: the full CNN round once, minutes).
QUICK_CLIENTS, FULL_CLIENTS = (8, 50), (50, 500)
PER_CLIENT, STEPS, BATCH = 50, 5, 10
#: The largest fraction of the round's time building its batches may take.
TARGET_FRACTION = 0.05


def _devices() -> list[str]:
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def client_data(clients: int) -> tuple[Any, Any]:
    """Every client's 50 images and one-hot labels, [clients, 50, ...] on the host (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(clients, PER_CLIENT, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (clients, PER_CLIENT), generator=g)
    return x, torch.nn.functional.one_hot(labels, 10).to(torch.float32)


def builders(clients: int, device: str) -> dict[str, Callable[[], Any]]:
    """The two ways to build one round's `(x, y)` batches `[clients, STEPS, BATCH, ...]`."""
    import torch

    import bridge_mr

    x, y = client_data(clients)
    ids = torch.arange(clients).repeat_interleave(PER_CLIENT)
    train = bridge_mr.data.FederatedDataset.from_tensors(
        {"x": x.flatten(0, 1), "y": y.flatten(0, 1)}, ids, device=device
    )
    ours = torch.Generator().manual_seed(1)

    def with_bridge_mr_data() -> tuple[Any, Any]:
        batches = train.round(batch_size=BATCH, steps=STEPS, generator=ours).batches
        return batches["x"], batches["y"]

    per_client_x, per_client_y = list(x.unbind()), list(y.unbind())
    theirs = torch.Generator().manual_seed(1)

    def torch_stack_loop() -> tuple[Any, Any]:
        xs, ys = [], []
        for cx, cy in zip(per_client_x, per_client_y, strict=True):
            order = torch.randperm(PER_CLIENT, generator=theirs)[: STEPS * BATCH]
            xs.append(cx[order].view(STEPS, BATCH, 3, 32, 32))
            ys.append(cy[order].view(STEPS, BATCH, 10))
        return torch.stack(xs).to(device), torch.stack(ys).to(device)

    return {"bridge_mr.data": with_bridge_mr_data, "torch_stack_loop": torch_stack_loop}


def round_seconds(clients: int, device: str, batches: tuple[Any, Any], calls: int) -> float:
    """The median seconds of the cnn case's bridge_mr FedAvg round on `batches`, after a
    first, compiling call."""
    cfg = workloads.round_config("cnn", clients)
    model = workloads.round_torch_model(cfg).to(device)
    params = dict(model.named_parameters())
    run = workloads.bridge_mr_fedavg(
        workloads.round_client_update(cfg, unroll=True), params, batches
    )
    harness.time_once(run)
    return statistics.median(harness.time_calls(run, calls))


def _row(ctx: harness.Context, case: report.CaseResult, clients: int, device: str) -> None:
    row_id = f"data/cnn/{device}/c{clients}"
    build = builders(clients, device)
    comparison = harness.compare(build, baseline="torch_stack_loop", policy=ctx.policy)
    params = {
        "clients": clients,
        "device": device,
        "examples_per_client": PER_CLIENT,
        "steps": STEPS,
        "batch": BATCH,
    }
    row = report.comparison_row(comparison, row_id, params, metrics={"clients_per_s": clients})
    calls = 1 if ctx.quick or clients > 50 else 3
    seconds = round_seconds(clients, device, build["bridge_mr.data"](), calls)
    row["params"]["round_s"] = seconds
    row["params"]["round_calls_timed"] = calls
    case.rows.append(row)
    for name in build:
        fraction = comparison.median(name) / seconds if comparison.ok(name) else None
        row["alternatives"][name]["fraction_of_round"] = fraction
    ours = row["alternatives"]["bridge_mr.data"].get("fraction_of_round")
    theirs = row["alternatives"]["torch_stack_loop"].get("fraction_of_round")
    case.targets.append(
        report.target(
            "data",
            row_id,
            "bridge_mr.data batch building time / bridge_mr round time",
            ours,
            TARGET_FRACTION,
            "<=",
            f"batches {report.versus(row, 'bridge_mr.data', 'torch_stack_loop')}; round "
            f"{report.format_time(seconds)}; the loop's fraction "
            + ("n/a" if theirs is None else f"{theirs:.1%}"),
        )
    )


def run(ctx: harness.Context) -> report.CaseResult:
    """The case: a row per device and client count (`ctx.clients` overrides the counts)."""
    clients = ctx.clients or (QUICK_CLIENTS if ctx.quick else FULL_CLIENTS)
    title = (
        "Building a round's client batches (pfl's CIFAR10 shape: 50 images per client, 5 steps "
        "of batch 10) vs the round they feed"
    )
    unit = (
        "time to build one round's [clients, 5, 10, ...] batches; (x) = ratio to the torch "
        "stack loop; fraction_of_round: over the bridge_mr FedAvg round's time"
    )
    with report.case_result("data", title, unit) as case:
        case.notes.append(
            "bridge_mr.data: FederatedDataset on the device, round() = a host index computation "
            "(one sort of a random key per example) + one gather per field. torch_stack_loop: "
            "per-client host tensors, a Python loop (randperm, index, view), torch.stack, .to("
            "device). Round: the cnn case's bridge_mr round (map_reduce, default strategy, "
            "unrolled local steps) on the bridge_mr.data batches, after a compiling call."
        )
        specs = [(device, c) for device in _devices() for c in clients]
        harness.each(
            specs,
            "data",
            lambda spec: _row(ctx, case, spec[1], spec[0]),
            lambda spec: f"{spec[0]} c{spec[1]}",
        )
    return case
