"""Case "accelerator" (issues 31, 41): the documented FedAvg round and the tiny call on the
device the user's tensors live on (`--device cpu` or `--device cuda`), or with host tensors on a
TPU host (`--device tpu`: the programs on the chip), against a torch loop, torch.func.vmap, every
bridge_mr strategy and the pure-JAX floor (`workloads.accelerator`), at each of torch's float32
matmul precisions asked for (`--precision highest medium`).

    python -m benchmarks --cases accelerator --device cuda   # the issue's rows
    python -m benchmarks --cases accelerator --device tpu --precision highest medium
    python -m benchmarks --cases accelerator --quick         # small rows, on the CPU

Every alternative runs in a fresh process of its own (`benchmarks.workers.users`, the
"users_path" case's worker and process handling), started one at a time: its first round there
(trace and compile included, imports excluded) is reported apart ("first round" rows), then the
later rounds are requested interleaved (A B C, B C A, ...) and their median reported; on a TPU
host one alternative at a time, each closed before the next starts (one process at a time can
hold the chip), the torch alternatives with `JAX_PLATFORMS=cpu`. On CUDA
the tensors are created on the GPU in each worker and the workers get `JAX_PLATFORMS=cpu,cuda`
and `XLA_PYTHON_CLIENT_PREALLOCATE=false` (unless set). Per alternative: the process's peak RSS,
and on CUDA its peak device memory (torch's allocator and JAX's, `workers.users`). Per row one
more short process counts the FLOPs of one call (`accelerator.flops`, the vmap program's jaxpr)
and gives the device's peak (`accelerator.device_peak`: a datasheet's, or on CPU a float32
matmul measured in that process), so that each alternative's achieved FLOP/s and its fraction
of the peak (the gap to the floor) are numbers.

Not in `python -m benchmarks`' default cases: ask for it with `--cases accelerator`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from .. import harness, report
from ..workloads import accelerator
from ..workloads.accelerator import AcceleratorConfig
from . import users_path

#: The rows: (model, clients, steps, batch), full (the issue's table) and --quick.
SIZES = {
    "full": (
        ("tiny", 4, 1, 16),
        ("cnn", 50, 5, 10),
        ("cnn", 500, 5, 10),
        ("gpt2_128", 16, 2, 4),
        ("gpt2_128", 128, 2, 4),
    ),
    "quick": (("tiny", 4, 1, 16), ("cnn", 4, 2, 4), ("gpt2_128", 4, 2, 4)),
}
#: Later rounds per alternative (interleaved): --quick, full; `--reps` overrides.
ROUNDS = (3, 5)
#: Calls per later-round request of the tiny call (its sample: their median).
TINY_CALLS = 20
#: The environment of a CUDA worker, where not set already (scripts/gpu_check.sh's).
CUDA_ENV = {"JAX_PLATFORMS": "cpu,cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}

TITLE = (
    "Accelerator rows (issue 31): the documented round and the tiny call on the tensors' device, "
    "each alternative in a fresh process"
)
UNIT = (
    "later rounds: median per round (tiny: per call) ±half-IQR, (x) ratio to the pure-JAX floor, "
    "achieved GFLOP/s (% of the device's peak), peak memory (CUDA: device, torch + JAX; CPU: "
    "RSS); 'first round' rows: one call in a fresh process, trace and compile included"
)


def _env(device: str, alternative: str | None = None) -> dict[str, str]:
    """A worker's environment: on CUDA `CUDA_ENV`'s defaults; on a TPU host the chip is left to
    the alternatives that run JAX on it (bridge_mr, pure JAX, the counting process), the torch
    loop and torch.func.vmap get `JAX_PLATFORMS=cpu`."""
    env = dict(os.environ)
    if device == "cuda":
        for key, value in CUDA_ENV.items():
            env.setdefault(key, value)
    if device == "tpu" and alternative is not None and alternative.startswith("torch"):
        env["JAX_PLATFORMS"] = "cpu"
    if alternative is not None and accelerator.on_torch_tpu(alternative):
        env["JAX_PLATFORMS"] = "cpu"  # TorchTPU holds the chip; JAX only traces.
    return env


def _start(
    name: str, cfg: AcceleratorConfig, save: str, timeout_s: float
) -> tuple[users_path._Worker | None, dict[str, Any]]:
    """Starts `name`'s worker, waits for its first round (`users_path.start_worker`)."""
    spec = {
        "workload": "accelerator",
        "alternative": name,
        "config": dataclasses.asdict(cfg),
        "save": save,
    }
    return users_path.start_worker(name, spec, timeout_s, env=_env(cfg.device, name))


def count(cfg: AcceleratorConfig, timeout_s: float = 600.0) -> dict[str, Any]:
    """One call's FLOPs and the device's peak, from a short process of their own:
    {"flops", "peak": {...}} or {"error"}."""
    spec = {"workload": "accelerator", "count": True, "config": dataclasses.asdict(cfg)}
    command = harness.fresh_process(sys.executable, "benchmarks.workers.users", json.dumps(spec))
    try:
        done = subprocess.run(
            command,
            cwd=harness.PACKAGE_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=_env(cfg.device),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"counting timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith('{"event"'):
            return json.loads(line)
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"error": f"counting exited with {done.returncode}: {tail[0]}"}


def measure(
    cfg: AcceleratorConfig,
    alternatives: tuple[str, ...],
    rounds: int,
    timeout_s: float = 1800.0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One row's later rounds and first rounds, with FLOPs, peaks and memory."""
    counted = count(cfg)
    runs = users_path.run_workers(
        alternatives,
        lambda name, save: _start(name, cfg, save, timeout_s),
        rounds,
        timeout_s,
        request=f"round {TINY_CALLS}" if cfg.model == "tiny" else "round",
        reference="torch_loop",
        one_at_a_time=cfg.device == "tpu",  # One process at a time can hold the chip.
    )
    entries, samples, closed, difference = runs.entries, runs.samples, runs.closed, runs.difference
    baseline = "pure_jax" if "pure_jax" in alternatives else alternatives[0]
    timings = {
        name: harness.Timing(samples[name], TINY_CALLS if cfg.model == "tiny" else 1)
        if name in samples
        else harness.Timing(error=entries[name].get("error", "not timed"))
        for name in alternatives
    }
    peak = counted.get("peak", {})
    params = {
        **dataclasses.asdict(cfg),
        "flops_per_round": counted.get("flops"),
        "device": peak.get("name", cfg.device),
        "peak_flop_per_s": peak.get("peak_flop_per_s"),
        "peak_source": peak.get("source", counted.get("error")),
        "max_abs_difference_after_first_round": difference,
    }
    row = report.comparison_row(harness.Comparison(baseline, timings), cfg.row_id, params)
    first_row = users_path.first_round_row(
        entries, alternatives, baseline, cfg.row_id, params, ("build_s",)
    )
    for name, entry in row["alternatives"].items():
        _annotate(entry, entries[name], closed.get(name), counted, peak)
    return row, first_row


def _annotate(
    entry: dict[str, Any],
    started: dict[str, Any],
    closed: dict[str, Any] | None,
    counted: dict[str, Any],
    peak: dict[str, Any],
) -> None:
    """Adds an alternative's first round, memory, FLOP/s and fraction of the peak."""
    for key in ("first_s", "build_s", "auto_choice"):
        if started.get(key) is not None:
            entry["first_round_s" if key == "first_s" else key] = started[key]
    if closed is not None:
        if closed.get("peak_rss_mb") is None:
            entry["memory"] = {"error": closed.get("error", "no peak reported")}
        else:
            imported = started["import_rss_mb"]
            entry["memory"] = {
                "peak_rss_mb": closed["peak_rss_mb"],
                "import_rss_mb": imported,
                "delta_rss_mb": closed["peak_rss_mb"] - imported,
                **{k: v for k, v in closed.items() if k.endswith("_peak_mb")},
            }
    flops = counted.get("flops")
    if "median_s" in entry and flops is not None:
        achieved = flops / entry["median_s"]
        entry["achieved_flop_per_s"] = achieved
        entry["gflop_per_s"] = achieved / 1e9
        top = peak.get("peak_flop_per_s")
        entry["fraction_of_peak"] = achieved / top if top else None
        if peak.get("fp32_flop_per_s"):
            entry["fraction_of_fp32_peak"] = achieved / peak["fp32_flop_per_s"]


def _configs(ctx: harness.Context) -> list[AcceleratorConfig]:
    sizes = SIZES["quick" if ctx.quick else "full"]
    models = ctx.models or accelerator.MODELS
    chosen = [s for s in sizes if s[0] in models]
    if ctx.clients:
        chosen = list(dict.fromkeys((m, c, st, b) for m, _, st, b in chosen for c in ctx.clients))
    return [
        AcceleratorConfig(m, c, st, b, device=ctx.device, precision=precision)
        for precision in ctx.precisions
        for m, c, st, b in chosen
    ]


def _note(row: dict[str, Any]) -> str:
    """The row's FLOPs, peak and agreement, and each alternative's time over the floor's."""
    params = row["params"]
    flops = params["flops_per_round"]
    text = f"{row['id']}: "
    text += f"{flops / 1e9:.4g} GFLOP per call" if flops is not None else "FLOPs n/a"
    if params["peak_flop_per_s"]:
        text += f"; peak {params['peak_flop_per_s'] / 1e12:.3g} TFLOP/s ({params['peak_source']})"
    else:
        text += f"; no peak ({params['peak_source']})"
    floor = row["alternatives"].get("pure_jax", {}).get("median_s")
    if floor:
        over = [
            f"{name} {entry['median_s'] / floor:.2f}x"
            for name, entry in row["alternatives"].items()
            if "median_s" in entry and name != "pure_jax"
        ]
        text += "; time over the pure-JAX floor: " + ", ".join(over)
    choice = row["alternatives"].get("bridge_mr", {}).get("auto_choice")
    if choice:
        text += f"; auto chose {choice}"
    differences = params["max_abs_difference_after_first_round"]
    if differences:
        text += "; first call's max |difference| from the torch loop: " + ", ".join(
            f"{n} {d:.2g}" for n, d in differences.items()
        )
    return text + "."


def run(
    ctx: harness.Context,
    configs: list[AcceleratorConfig] | None = None,
    rounds: int | None = None,
) -> report.CaseResult:
    """Every configured row: first rounds, interleaved later rounds, FLOPs, peaks, memory.

    Args:
      ctx: the run's settings (`quick`, `device`, `models`, `clients`, `round_alternatives`,
        `rounds`).
      configs: the rows to measure instead of `SIZES`'.
      rounds: later rounds per alternative instead of `ctx.rounds` / `ROUNDS`'.
    """
    configs = configs if configs is not None else _configs(ctx)
    if rounds is None:
        rounds = ctx.rounds if ctx.rounds is not None else ROUNDS[0 if ctx.quick else 1]
    chosen = tuple(
        a
        for a in (ctx.round_alternatives or ())
        if a in accelerator.ALTERNATIVES
        or a.startswith(("bridge_mr:", "bridge_mr_resident:", "bridge_mr_torchtpu:"))
        or a in accelerator.TORCH_TPU_ALTERNATIVES
    )
    alternatives = chosen or accelerator.ALTERNATIVES
    note = (
        "Rounds: FedAvg, `steps` local SGD steps of `batch` examples per client, lr 0.05, "
        "server SGD(lr=1.0) on minus the mean delta; cnn = pfl-research's CIFAR10 simple_cnn "
        "without dropout; gpt2_128 = GPT2LMHeadModel, 2 layers of width 128, 32 tokens; tiny = "
        "one map_reduce forward+backward of the overhead case's MLP (4 clients, width 8). "
        "bridge_mr = strategy auto; bridge_mr:NAME[:CHUNK] forced; bridge_mr_resident = auto "
        "with the client data held as JAX arrays where the program runs (data on the chip: "
        "FederatedDataset.to(jax_device)); *_torchtpu = on TorchTPU's 'tpu' tensors. "
        "pure_jax = jax.jit(jax.vmap) of the same converted client, the floor. FLOPs: "
        "matmul/conv work of one call "
        "(bridge_mr.auto.cost of the vmap program), the same for every alternative."
    )
    with report.case_result("accelerator", TITLE, UNIT, note) as case:

        def one(cfg: AcceleratorConfig) -> None:
            row, first = measure(cfg, alternatives, rounds)
            case.rows += [row, first]
            case.notes.append(_note(row))

        harness.each(configs, case.name, one)
    return case
