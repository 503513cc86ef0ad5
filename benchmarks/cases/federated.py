"""Cases 3 and 4: FedSGD / FedAvg rounds against every alternative, and scaling with clients.

Every row is one interleaved comparison of the alternatives in `workloads`, baseline `drjax`
(the same program in pure JAX). torch-xla rows run in a separate process in the torch-xla
environment (`.venv-xla`), interleaved among themselves, baseline `torch_xla`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from .. import harness, report, workloads
from ..workloads import FedConfig

BASELINE = "drjax"
XLA_PYTHON = os.path.join(harness.PACKAGE_ROOT, ".venv-xla", "bin", "python")


def _baseline(ctx: harness.Context) -> str:
    return BASELINE if BASELINE in ctx.alternatives else ctx.alternatives[0]


def measure_configs(
    ctx: harness.Context,
    configs: list[FedConfig],
    memory: list[bool],
    desc: str,
    max_clients: dict[str, int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, harness.Comparison]]:
    """Times each config's round for every alternative; peak RSS where `memory` says so.

    Args:
      ctx: the run's settings (alternatives, timing policy).
      configs: the rounds, one row each.
      memory: per config, whether to measure each alternative's peak RSS in a child process.
      desc: the progress bar's label.
      max_clients: alternative -> the most clients it is run with (cut above, and said so).
    """
    rows, comparisons = [], {}
    alternatives = ctx.alternatives
    steps = len(configs) + len(alternatives) * sum(memory)
    with harness.progress(steps, desc) as bar:
        for cfg, with_memory in zip(configs, memory, strict=True):
            bar.set_postfix_str(cfg.row_id)
            built = {
                name: workloads.build(name, cfg)
                if cfg.clients <= (max_clients or {}).get(name, cfg.clients)
                else f"cut above {(max_clients or {})[name]} clients (time budget)"
                for name in alternatives
            }
            comparison = harness.compare(built, baseline=_baseline(ctx), policy=ctx.policy)
            del built  # Frees the rounds' buffers before the next config.
            row = report.comparison_row(
                comparison,
                cfg.row_id,
                cfg.params(),
                metrics={"client_updates_per_s": cfg.clients},
            )
            bar.update()
            for name in alternatives if with_memory else ():
                bar.set_postfix_str(f"{cfg.row_id} peak RSS of {name}")
                if comparison.ok(name):
                    spec = {"alternative": name, "config": dataclasses.asdict(cfg)}
                    row["alternatives"][name]["memory"] = harness.peak_rss(spec, calls=1)
                bar.update()
            rows.append(row)
            comparisons[row["id"]] = comparison
    return rows, comparisons


def _round_configs(ctx: harness.Context, algo: str) -> tuple[list[FedConfig], list[str]]:
    notes = []
    if ctx.quick and algo == "fedsgd":
        sizes = {"small": (8, 64), "medium": (8,)}
        notes.append("--quick: clients {8, 64} for the small model and 8 for the medium one.")
    elif ctx.quick:
        sizes = {"small": (8, 64)}
        notes.append("--quick: the small model at 8 and 64 clients only.")
    else:
        sizes = {"small": (8, 64, 512), "medium": (8, 64, 512) if algo == "fedsgd" else (8, 64)}
        if algo == "fedavg":
            notes.append(
                "Cut: medium model x 512 clients for FedAvg (1.1 TFLOP per round: about 8x the "
                "64-client row, roughly 25 s per round and alternative here; 4 alternatives x "
                "4+ rounds do not fit the 15-minute run)."
            )
    models = ctx.models or tuple(sizes)
    configs = [FedConfig(algo, model, c) for model in models for c in (ctx.clients or sizes[model])]
    return configs, notes


def _model_targets(cfg: FedConfig) -> list[tuple[str, float, str]]:
    """The map-strategies issue's targets for `cfg`'s row: (reference, bound on bridge_mr's
    time over the reference's, description)."""
    if cfg.algo == "fedsgd" and cfg.model == "medium" and cfg.clients >= 64:
        return [
            ("torch_vmap", 1.0, "bridge_mr time / torch.func.vmap time"),
            ("drjax", 0.5, "bridge_mr time / drjax time (2x faster)"),
        ]
    if cfg.algo == "fedavg" and cfg.model == "medium":
        return [("torch_loop", 1.0, "bridge_mr time / torch loop time")]
    if cfg.algo == "fedsgd" and cfg.model == "small" and cfg.clients == 8:
        return [("drjax", 1.5, "bridge_mr time / drjax time (small, fixed cost)")]
    return []


def run_rounds(ctx: harness.Context, algo: str) -> report.CaseResult:
    """Case 3: one FedSGD or FedAvg round, every alternative, small and medium models.

    Peak RSS ("auto"): the medium-model row with the most clients, in the full run.
    """
    configs, notes = _round_configs(ctx, algo)
    title = {
        "fedsgd": "FedSGD round (mean client loss, gradient, one SGD step on the server)",
        "fedavg": f"FedAvg round ({configs[0].local_steps} local SGD steps per client, mean delta)",
    }[algo]
    unit = (
        "time per round; (x) = ratio to the row's baseline (paired per repetition); client "
        "updates/s; peak RSS of a fresh process that builds and runs that round once"
    )
    with report.case_result(algo, title, unit) as case:
        case.notes += notes
        case.notes.append(
            f"Per client per step: a batch of {configs[0].batch} examples; models: small "
            f"{workloads.MODELS['small']} = {workloads.n_params(workloads.MODELS['small']):,} "
            f"parameters, medium {workloads.MODELS['medium']} = "
            f"{workloads.n_params(workloads.MODELS['medium']):,} parameters (float32)."
        )
        largest = max((cfg.clients for cfg in configs if cfg.model == "medium"), default=None)
        memory = [
            ctx.wants_memory(not ctx.quick and cfg.model == "medium" and cfg.clients == largest)
            for cfg in configs
        ]
        rows, comparisons = measure_configs(ctx, configs, memory, algo)
        case.rows += rows
        for cfg, row in zip(configs, rows, strict=True):
            case.targets += _round_targets(cfg, row, comparisons[row["id"]])
        if ctx.xla:
            case.rows += xla_rows(ctx, configs, case)
    return case


def _round_targets(
    cfg: FedConfig, row: dict[str, Any], comparison: harness.Comparison
) -> list[dict[str, Any]]:
    """The targets of one round's row: bridge_mr against drjax, and `_model_targets`'."""
    references = [(BASELINE, 1.10, "bridge_mr time / drjax time"), *_model_targets(cfg)]
    targets = [
        report.paired_target(
            cfg.algo,
            row,
            what,
            comparison.ratio("bridge_mr", reference),
            threshold,
            "<=",
            ("bridge_mr", reference),
        )
        for reference, threshold, what in references
    ]
    if cfg.algo == "fedavg" and cfg.model == "small" and cfg.local_steps >= 10:
        targets.append(
            report.paired_target(
                cfg.algo,
                row,
                "bridge_mr throughput / torch.func.vmap throughput",
                comparison.ratio("torch_vmap", "bridge_mr"),
                2.0,
                ">=",
                ("bridge_mr", "torch_vmap"),
            )
        )
    return targets


def run_scaling(ctx: harness.Context) -> report.CaseResult:
    """Case 4: FedAvg round time and peak RSS against the number of clients, small model.

    Peak RSS ("auto"): every row of the full run, the largest client count of --quick.
    """
    clients = ctx.clients or ((16, 128) if ctx.quick else (8, 32, 128, 512, 2048))
    configs = [FedConfig("fedavg", "small", c) for c in clients]
    title = (
        f"Scaling: small-model FedAvg round ({configs[0].local_steps} local steps) vs number of "
        "clients"
    )
    unit = (
        "time per round; (x) = ratio to drjax; client updates/s; peak RSS of a fresh process "
        "that builds and runs that round once"
    )
    with report.case_result("scaling", title, unit) as case:
        if ctx.quick:
            case.notes.append(
                "--quick: clients {16, 128}, peak RSS at 128 only (the full run: 8 to 2048, "
                "peak RSS at each)."
            )
        if max(clients) > 512:
            case.notes.append(
                "Cut: torch_loop above 512 clients (one Python iteration per client and step, "
                "so linear in clients; at 2048 clients a round took 17 s in a trial run here)."
            )
        memory = [ctx.wants_memory(not ctx.quick or c == max(clients)) for c in clients]
        limits = {"torch_loop": 512}
        rows, _ = measure_configs(ctx, configs, memory, "scaling", max_clients=limits)
        for row in rows:
            row["id"] = f"c{row['params']['clients']}"
        case.rows += rows
    return case


def xla_rows(
    ctx: harness.Context, configs: list[FedConfig], case: report.CaseResult
) -> list[dict[str, Any]]:
    """torch-xla rows (`bench_xla.measure`) for the small model up to 64 clients and the medium
    one at 8 or fewer. --quick: the first FedAvg one only.

    Runs in this process if torch_xla is importable here, else in a child process of
    `.venv-xla/bin/python` when that exists; otherwise adds a note and returns no rows.
    """
    chosen = [cfg for cfg in configs if cfg.clients <= (64 if cfg.model == "small" else 8)]
    if ctx.quick:
        chosen = [cfg for cfg in chosen if cfg.algo == "fedavg"][:1]
    if not chosen:
        return []
    if _has_torch_xla():
        from ..studies import bench_xla

        result = bench_xla.measure(chosen, ctx.policy)
    elif os.path.exists(XLA_PYTHON):
        spec = {
            "configs": [dataclasses.asdict(cfg) for cfg in chosen],
            "policy": dataclasses.asdict(ctx.policy),
        }
        print(f"{case.name}: torch-xla rows in {XLA_PYTHON} ...", file=sys.stderr)
        done = subprocess.run(
            [XLA_PYTHON, "-m", "benchmarks.studies.bench_xla", "--spec", json.dumps(spec)],
            cwd=harness.PACKAGE_ROOT,
            env={**os.environ, "PJRT_DEVICE": "CPU"},
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            case.notes.append(f"torch-xla rows failed: the child exited with {done.returncode}.")
            return []
        result = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        case.notes.append("No torch-xla rows: torch_xla is not importable and .venv-xla is absent.")
        return []
    rows = result["rows"]
    case.notes.append(
        "torch-xla rows (suffix /xla, `python -m benchmarks.studies.bench_xla`): "
        f"torch {result['torch']}, "
        f"torch_xla {result['torch_xla']} on {result['device']} (PJRT_DEVICE=CPU), XLA_FLAGS "
        f"{result['xla_flags']!r}; a separate process unless run in "
        "that environment; its alternatives are interleaved with each other only, baseline "
        "torch_xla (pure torch-xla: torch.func.vmap + functional_call on the XLA device). Only "
        "the small model up to 64 clients and the medium one at 8 (time budget)."
    )
    case.targets += [
        report.paired_target(
            case.name,
            row,
            "bridge_mr on torch-xla time / pure torch-xla time",
            row["alternatives"].get("bridge_mr_xla", {}).get("ratio_to_baseline"),
            1.0,
            "<=",
            ("bridge_mr_xla", "torch_xla"),
        )
        for row in rows
    ]
    return rows


def _has_torch_xla() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None
