"""Case "users_path": the round docs/algorithms.md tells users to write, against what they would
write instead: a plain torch loop, pfl-research, torch.func.vmap (`workloads.users`).

Every alternative runs in a fresh process of its own (`benchmarks.workers.users`; pfl's in the
pfl venv, `PFL_PYTHON`), started one at a time while the others wait idle: its first round
there is the first-call time a user sees (imports excluded, building the model and data timed
apart), its peak RSS is that process's. Then the later rounds are requested from the workers
interleaved (A B C D, B C D A, ...), one at a time, each with the 1-minute load average and the
CPU time other processes used during it (the machine's busy time from /proc/stat less this
process's and the worker's). Separate processes also keep one library's threads from competing
with another's: torch's two OpenMP threads slow down many times over when anything else holds a
core (see benchmarks/results/NOTES.md, 2026-12-02 users_path).

All start from the same parameters (each builds the seeded model) and data, so the parameters
after their first rounds are compared: the row's `max_abs_difference_after_first_round`.

Run: `python -m benchmarks --cases users_path` (`--quick`: small rounds; `--models`,
`--clients`, `--alternatives` narrow it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import numpy as np

from .. import harness, report
from ..environment import LoadMeter
from ..workloads import users

BASELINE = "torch_loop"
#: The alternatives measured by default: the default strategy, and per_client forced.
DEFAULT_ALTERNATIVES = ("torch_loop", "pfl", "bridge_mr", "bridge_mr:per_client", "torch_vmap")

#: The interpreter of the pfl venv (pfl pins absl / packaging versions the main venv is past):
#: `python3 -m venv .venv-pfl && .venv-pfl/bin/pip install "torch==2.13.0+cpu"
#: "pfl[pytorch]==0.6.*" "transformers==5.24.0"`.
PFL_PYTHON = os.path.join(harness.PACKAGE_ROOT, ".venv-pfl", "bin", "python")

#: (model, clients) of the --quick run and of the full run.
SIZES = (
    (("cnn", 4), ("gpt2", 4), ("resnet18", 2)),
    (("cnn", 50), ("cnn", 16), ("gpt2", 16), ("resnet18", 16)),
)
#: Later rounds per alternative (interleaved): --quick, full.
ROUNDS = (3, 5)

#: Per model, the largest max |difference| between an alternative's parameters after its first
#: round and the torch loop's for them to count as computing the same round (float32, other
#: summation orders). The ResNet's round amplifies rounding: its BatchNorms normalise the last
#: stage's 1x1 maps over a batch of 10 values, and a relative 1e-6 change of the initial
#: parameters moved the torch loop's round by 2e-3 (its parameters move by 0.1-0.3 in a round),
#: so 1e-2 is what float32 allows. bridge_mr's round differed from the torch loop's by 0.019
#: (Intel Xeon, 10 clients) and 0.024 (AMD EPYC without AVX-512, 2 clients) while XLA:CPU
#: summed BatchNorm's statistics in one sequential accumulator; with the sums in levels
#: (`jax_core.cpu_program`) by 5.9e-3 (10 clients) and 1.1e-4 (2 clients); torch.func.vmap's
#: by 1e-5. On an Intel Xeon with AVX-512 and AMX (2026-12-06) it differed by 0.0235 at 2
#: clients (2 steps of 4 images), and so does the round itself in exact arithmetic: in float64
#: the torch loop's round moved by 0.0235 when its images were scaled by 1 + 1e-7 N(0, 1) (one
#: seed of three; 6e-5 and 1.1e-4 for the others), and float32 torch with those images lands
#: there for all three (a discrete step: a max-pool's or ReLU's choice that rounding flips),
#: while bridge_mr in float64 matches the float64 torch loop to 6e-13. So the ResNet's bound
#: lies above that step.
AGREEMENT_ATOL = {"cnn": 1e-4, "gpt2": 1e-4, "resnet18": 5e-2}

TITLE = (
    "The documented round (from_torch + algorithms.local_training + outer_step) against a torch "
    "loop, pfl-research and torch.func.vmap, each in a fresh process"
)
UNIT = (
    "later rounds: median time per round, (x) median of per-round ratios to the torch loop, "
    "peak RSS of the alternative's process; 'first round' rows: one call in a fresh process"
)
NOTE = (
    "{steps} local SGD steps of batch {batch} per client, lr {lr}, server SGD(lr=1.0) on minus "
    "the mean delta. bridge_mr: map_reduce's default strategy unless named (bridge_mr:NAME). "
    "torch_loop: one local nn.Module loads the server's state_dict per client, a fresh "
    "torch.optim.SGD, a plain loop. pfl: FederatedAveraging on SimulatedBackend, evaluation "
    "off. Models: cnn = pfl-research's CIFAR10 simple_cnn without its dropouts; gpt2 = "
    "GPT2LMHeadModel (zoo's small config); resnet18 = ResNetForImageClassification, ResNet-18's "
    "depths at a quarter of its widths, BatchNorm on batch statistics."
)


@dataclasses.dataclass
class _Worker:
    """A fresh process serving one alternative's rounds (`benchmarks.workers.users`)."""

    name: str
    process: subprocess.Popen[str]
    stderr: TextIO
    ready: dict[str, Any]

    def request(self, command: str, timeout_s: float) -> dict[str, Any]:
        """Sends `command`, returns the worker's answer (a JSON event)."""
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return _answer(self, timeout_s)

    def close(self) -> dict[str, Any]:
        """Asks the worker to quit; its last event (peak RSS), or {"error": ...}."""
        try:
            done = self.request("quit", 60.0)
        except (OSError, RuntimeError) as err:
            done = {"error": str(err)}
        self.release()
        return done

    def release(self) -> None:
        """Waits for the process (killed if still running) and closes its pipes and files."""
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()


def _answer(worker: _Worker, timeout_s: float) -> dict[str, Any]:
    """The worker's next event; lines that are not events (a library's print) are skipped."""
    stdout = worker.process.stdout
    assert stdout is not None
    while True:
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        line = stdout.readline() if ready else ""
        if not line:
            if not ready:
                worker.process.kill()
            worker.process.wait()
            worker.stderr.flush()
            worker.stderr.seek(0)
            tail = worker.stderr.read().strip().splitlines()[-1:] or ["no output"]
            why = f"timed out after {timeout_s:.0f} s" if not ready else "exited"
            raise RuntimeError(f"{worker.name} worker {why}: {tail[0]}")
        if line.startswith('{"event"'):
            return json.loads(line)


def _start(
    name: str, cfg: users.UserConfig, save: str, timeout_s: float
) -> tuple[_Worker | None, dict[str, Any]]:
    """Starts `name`'s worker and waits for its first round (`start_worker`)."""
    python = PFL_PYTHON if name == "pfl" else sys.executable
    if not os.path.exists(python):
        return None, {
            "error": f"not available: no pfl venv at {python} (create it as PFL_PYTHON says)"
        }
    spec = {"alternative": name, "config": dataclasses.asdict(cfg), "save": save}
    return start_worker(name, spec, timeout_s, python=python)


def start_worker(
    name: str,
    spec: dict[str, Any],
    timeout_s: float,
    *,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> tuple[_Worker | None, dict[str, Any]]:
    """Starts a `benchmarks.workers.users` process for `spec` and waits for its first round:
    (worker, first-round facts and the CPUs other processes kept busy meanwhile), or
    (None, {"error": why})."""
    stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed with the worker)
    process = subprocess.Popen(
        harness.fresh_process(python, "benchmarks.workers.users", json.dumps(spec)),
        cwd=harness.PACKAGE_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    worker = _Worker(name, process, stderr, {})
    meter = LoadMeter()
    try:
        worker.ready = _answer(worker, timeout_s)
    except RuntimeError as err:
        worker.release()
        return None, {"error": str(err)}
    load = meter.read(also_own_s=worker.ready["cpu_total_s"])
    return worker, {**worker.ready, "other_cpus_busy": load["other_cpus_busy"]}


def _interleaved(
    workers: list[_Worker], rounds: int, timeout_s: float, request: str
) -> Iterator[Any]:
    """Yields (name, answer, load_1min, other_cpus_busy) for each `request`: `rounds` of every
    worker, the order rotating each time."""
    for index in range(rounds):
        order = workers[index % len(workers) :] + workers[: index % len(workers)]
        for worker in order:
            meter, load_1min = LoadMeter(), os.getloadavg()[0]
            answer = worker.request(request, timeout_s)
            other = meter.read(also_own_s=answer["cpu_s"])["other_cpus_busy"]
            yield worker.name, answer, load_1min, other


def _difference(path: str, reference: str) -> float:
    with np.load(path) as a, np.load(reference) as b:
        if len(a.files) != len(b.files):
            return float("inf")
        return max(float(np.abs(a[k] - b[k]).max()) for k in b.files)


@dataclasses.dataclass
class Runs:
    """What `run_workers` saw: per alternative its first-round facts (`entries`), its later
    calls' seconds and loads (those that started), what it said on quitting, and its
    parameters' max |difference| from the reference's after the first round."""

    entries: dict[str, dict[str, Any]]
    samples: dict[str, list[float]]
    loads: dict[str, list[dict[str, Any]]]
    closed: dict[str, dict[str, Any]]
    difference: dict[str, float]


def run_workers(
    alternatives: tuple[str, ...],
    start: Callable[[str, str], tuple[_Worker | None, dict[str, Any]]],
    rounds: int,
    timeout_s: float,
    *,
    request: str = "round",
    reference: str = BASELINE,
    one_at_a_time: bool = False,
) -> Runs:
    """Starts each alternative's worker one at a time (`start(name, save_path)`), then asks
    them for `rounds` of `request` interleaved, then closes them.

    With `one_at_a_time`, each worker serves its rounds and is closed before the next starts:
    for a device only one process can hold (a TPU chip), where interleaving cannot be had.
    """
    entries: dict[str, dict[str, Any]] = {}
    workers: list[_Worker] = []
    samples: dict[str, list[float]] = {}
    loads: dict[str, list[dict[str, Any]]] = {}
    closed: dict[str, dict[str, Any]] = {}

    def serve(group: list[_Worker]) -> None:
        for name, answer, load_1min, other in _interleaved(group, rounds, timeout_s, request):
            samples.setdefault(name, []).append(answer["seconds"])
            loads.setdefault(name, []).append({"load_1min": load_1min, "other_cpus_busy": other})

    with tempfile.TemporaryDirectory() as tmp:
        saved = {name: os.path.join(tmp, f"{i}.npz") for i, name in enumerate(alternatives)}
        try:
            for name in alternatives:
                worker, first = start(name, saved[name])
                entries[name] = first
                if worker is None:
                    continue
                workers.append(worker)
                if one_at_a_time:
                    try:
                        serve([worker])
                    finally:
                        closed[worker.name] = workers.pop().close()
            if workers:
                serve(workers)
        finally:
            closed.update({w.name: w.close() for w in workers})
        kept = saved.get(reference)
        difference = {
            w.name: _difference(saved[w.name], kept)
            for w in workers
            if kept is not None and w.name != reference and os.path.exists(kept)
        }
    return Runs(entries, samples, loads, closed, difference)


def measure(
    cfg: users.UserConfig, alternatives: tuple[str, ...], rounds: int, timeout_s: float = 1800.0
) -> tuple[dict[str, Any], dict[str, Any], harness.Comparison]:
    """One round's rows (later rounds, first rounds) and the later rounds' comparison."""
    runs = run_workers(
        alternatives, lambda name, save: _start(name, cfg, save, timeout_s), rounds, timeout_s
    )
    entries, samples, loads, closed = runs.entries, runs.samples, runs.loads, runs.closed
    difference = runs.difference
    timings = {
        name: harness.Timing(samples[name], 1) if name in samples else harness.Timing(error=e)
        for name, e in ((n, entries[n].get("error")) for n in alternatives)
    }
    params = {
        **dataclasses.asdict(cfg),
        "max_abs_difference_after_first_round": difference,
    }
    comparison = harness.Comparison(BASELINE, timings)
    row = report.comparison_row(comparison, cfg.row_id, params)
    for name, entry in row["alternatives"].items():
        if name in closed:
            peak = closed[name].get("peak_rss_mb")
            imported = entries[name]["import_rss_mb"]
            entry["memory"] = (
                {"peak_rss_mb": peak, "import_rss_mb": imported, "delta_rss_mb": peak - imported}
                if peak is not None
                else {"error": closed[name].get("error", "no peak RSS reported")}
            )
            entry["load"] = loads[name]
    keys = ("build_s", "other_cpus_busy")
    first_row = first_round_row(
        entries, alternatives, BASELINE, cfg.row_id, dataclasses.asdict(cfg), keys
    )
    return row, first_row, comparison


def first_round_row(
    entries: dict[str, dict[str, Any]],
    alternatives: tuple[str, ...],
    baseline: str,
    row_id: str,
    params: dict[str, Any],
    keys: tuple[str, ...],
) -> dict[str, Any]:
    """The "<row_id> first round" row: each alternative's first round (one call in its fresh
    process, `run_workers`' entries) or its error, with `keys` of its entry where it has them."""
    first = {
        name: harness.Timing([entries[name]["first_s"]], 1)
        if "first_s" in entries[name]
        else harness.Timing(error=entries[name]["error"])
        for name in alternatives
    }
    row = report.comparison_row(
        harness.Comparison(baseline, first), f"{row_id} first round", params
    )
    for name, entry in row["alternatives"].items():
        for key in keys:
            if key in entries[name]:
                entry[key] = entries[name][key]
    return row


def _configs(ctx: harness.Context) -> list[users.UserConfig]:
    sizes = SIZES[0] if ctx.quick else SIZES[1]
    models = [m for m in dict.fromkeys(m for m, _ in sizes) if not ctx.models or m in ctx.models]
    if ctx.clients:
        return [users.UserConfig(m, c) for m in models for c in ctx.clients]
    return [users.UserConfig(m, c) for m, c in sizes if m in models]


def _load_note(row: dict[str, Any]) -> str:
    """The load during the row's later rounds: the largest 1-minute average and the median and
    largest CPUs other processes kept busy."""
    loads = [x for e in row["alternatives"].values() for x in e.get("load", [])]
    if not loads:
        return f"{row['id']}: no rounds timed."
    others = [x["other_cpus_busy"] for x in loads if x["other_cpus_busy"] is not None]
    text = f"{row['id']}: load during its {len(loads)} timed rounds: 1-min average up to "
    text += f"{max(x['load_1min'] for x in loads):.2f}"
    if others:
        text += (
            f", other processes' CPUs median {statistics.median(others):.2f}, max {max(others):.2f}"
        )
    differences = row["params"]["max_abs_difference_after_first_round"]
    atol = AGREEMENT_ATOL[row["params"]["model"]]
    disagree = [n for n, d in differences.items() if not d <= atol]
    text += "; first round's max |difference| from the torch loop: " + ", ".join(
        f"{n} {d:.2g}" for n, d in differences.items()
    )
    return text + (f" (over {atol:g}: {', '.join(disagree)})." if disagree else ".")


def run(
    ctx: harness.Context,
    configs: list[users.UserConfig] | None = None,
    rounds: int | None = None,
) -> report.CaseResult:
    """Every configured round: first rounds, interleaved later rounds, agreement, targets.

    Args:
      ctx: the run's settings (`quick`, `models`, `clients`, `round_alternatives`).
      configs: the rounds to measure instead of `SIZES`'.
      rounds: later rounds per alternative instead of `ROUNDS`'.
    """
    configs = configs if configs is not None else _configs(ctx)
    rounds = rounds if rounds is not None else ROUNDS[0 if ctx.quick else 1]
    chosen = tuple(a for a in (ctx.round_alternatives or ()) if a in users.ALTERNATIVES or ":" in a)
    alternatives = tuple(dict.fromkeys((BASELINE, *chosen))) if chosen else DEFAULT_ALTERNATIVES
    cfg0 = configs[0]
    note = NOTE.format(steps=cfg0.steps, batch=cfg0.batch, lr=cfg0.lr)
    with report.case_result("users_path", TITLE, UNIT, note) as case:

        def one(cfg: users.UserConfig) -> None:
            row, first, comparison = measure(cfg, alternatives, rounds)
            case.rows += [row, first]
            case.notes.append(_load_note(row))
            if cfg.model == "cnn":
                _targets(case, row, comparison)

        harness.each(configs, case.name, one)
    return case


def _targets(case: report.CaseResult, row: dict[str, Any], comparison: harness.Comparison) -> None:
    """Issue 24's targets on the CNN round: bridge_mr (default strategy) at most 1.0x the torch
    loop and 1.0x pfl, as medians of per-round ratios (each pair from one interleaved round)."""
    for reference in (BASELINE, "pfl"):
        case.targets.append(
            report.paired_target(
                case.name,
                row,
                f"bridge_mr (default strategy) round / {reference} round",
                comparison.ratio("bridge_mr", reference),
                1.0,
                "<=",
                ("bridge_mr", reference),
            )
        )
