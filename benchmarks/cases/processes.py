"""Case "processes": FedSGD and FedAvg rounds in one process against two (torchrun).

The same 16 clients (an MLP 64 -> hidden -> 10, batch 32; FedAvg: 2 local SGD steps) run in one
process, and split 8 + 8 over two torchrun processes (`map_reduce` over every rank's clients;
gloo between the processes, one CPU device per process in the cross-process program). Each
hidden width sets the payload: the parameters whose gradients (FedSGD) or deltas (FedAvg) the
processes all-reduce every round. The two-process run also times that all-reduce alone (a
jitted sum of a [processes, payload] array, one row per process) and the agreement every call
makes first (`bridge_mr.distributed.agree`: client counts and the call's fingerprint, one small
gather).

The one- and two-process rounds run in separate launches, one after the other, so their ratio
is not paired within a repetition as other cases' are; on this 2-core machine the two
processes also share the cores the one process has to itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

from .. import harness, report

#: The torchrun worker, run as a module of this package (it times through the harness).
WORKER = "benchmarks.workers.processes"
ONE, TWO, ALL_REDUCE, AGREE = "one_process", "two_processes", "all_reduce_only", "agree_only"
CLIENTS = 16
FEATURES, CLASSES = 64, 10
#: Hidden widths: the --quick run, the full run.
HIDDENS = ((256,), (256, 4096, 32768))


def payload(hidden: int) -> int:
    """The parameters of the MLP (what a round all-reduces)."""
    return FEATURES * hidden + hidden + hidden * CLASSES + CLASSES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, hiddens: tuple[int, ...], reps: int, timeout: float = 1200) -> dict:
    """Runs the worker under torchrun; returns rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timings.json")
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={processes}",
                f"--master-port={_free_port()}",
                "-m",
                WORKER,
                out,
                str(CLIENTS),
                str(reps),
                ",".join(map(str, hiddens)),
            ],
            cwd=harness.PACKAGE_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"the {processes}-process worker failed:\n{run.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def run(ctx: harness.Context) -> report.CaseResult:
    """Both rounds at each payload, in one process and in two."""
    hiddens = HIDDENS[0] if ctx.quick else HIDDENS[1]
    reps = max(ctx.policy.min_reps, 5)
    title = f"FedSGD / FedAvg rounds of {CLIENTS} clients: one process against two (torchrun, gloo)"
    unit = (
        "time per round (x = ratio to one process, from separate launches); all_reduce_only / "
        "agree_only: that collective alone, in the two-process run"
    )
    with report.case_result("processes", title, unit) as case:
        case.notes.append(
            "The two launches run one after the other, not interleaved; two processes share "
            "this machine's cores. two_processes - one_process is what crossing processes "
            "costs per round here; all_reduce_only is the payload's all-reduce, agree_only the "
            "per-call agreement (client counts and the call's fingerprint)."
        )
        with harness.progress(2, "processes") as bar:
            one = launch(1, hiddens, reps)
            bar.update()
            two = launch(2, hiddens, reps)
            bar.update()
    for hidden in hiddens:
        for kind in ("fedsgd", "fedavg"):
            key = f"{kind}/{hidden}"
            timings = {
                ONE: harness.Timing(one[key]["round"], 1),
                TWO: harness.Timing(two[key]["round"], 1),
                ALL_REDUCE: harness.Timing(two[key]["all_reduce"], 1),
                AGREE: harness.Timing(two[key]["agree"], 1),
            }
            comparison = harness.Comparison(ONE, timings)
            n = payload(hidden)
            case.rows.append(
                report.comparison_row(
                    comparison,
                    f"{kind}/p{n}",
                    {"round": kind, "clients": CLIENTS, "params": n, "payload_mib": n * 4 / 2**20},
                )
            )
    return case
