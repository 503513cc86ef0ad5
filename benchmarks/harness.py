"""Measurement: interleaved timed repetitions, synced clocks, peak RSS of a fresh child process.

The suite's only clock: every case and every `python -m benchmarks.*` entry point times through
`compare` (interleaved repetitions), or, for what `compare` cannot time, through `time_once` (a
first call), `time_calls` (calls in a row) and `rounds` (a few rounds of calls in a fixed
order), so that every number is taken the same way: the clock stops once the results are synced.

Every alternative of a comparison is a zero-argument callable that does one unit of work (one
round, one call) and returns its results. The clock stops only after those results are synced:
JAX arrays are blocked on, torch-xla tensors are synced and waited for, CUDA is synchronised
(CPU torch tensors are already materialised when eager torch returns them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sync(result: Any) -> None:
    """Waits until every array or tensor in `result` (nested lists/tuples/dicts) is computed."""
    leaves = list(_leaves(result))
    xla_pending = False
    for leaf in leaves:
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
        elif type(leaf).__module__.startswith("torch"):
            device_type = getattr(getattr(leaf, "device", None), "type", "cpu")
            if device_type == "xla":
                xla_pending = True
            elif device_type == "cuda":
                import torch

                torch.cuda.synchronize(leaf.device)
            elif device_type == "tpu":  # TorchTPU's.
                import torch

                torch.accelerator.synchronize(leaf.device)
    if xla_pending:
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()


def _leaves(tree: Any) -> Iterable[Any]:
    if isinstance(tree, Mapping):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    elif tree is not None:
        yield tree


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three equal for a single value."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


@dataclasses.dataclass
class Timing:
    """Seconds per call of one alternative: one sample per repetition.

    Attributes:
      samples: mean seconds per call within each repetition, in repetition order.
      number: calls per repetition (chosen so that a repetition lasts long enough to time).
      error: why the alternative could not be timed; then `samples` is empty.
    """

    samples: list[float] = dataclasses.field(default_factory=list)
    number: int = 0
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """Median, quartiles and extremes in seconds, or the error."""
        if self.error is not None:
            return {"error": self.error}
        q1, median, q3 = _quantiles(self.samples)
        return {
            "median_s": median,
            "q1_s": q1,
            "q3_s": q3,
            "min_s": min(self.samples),
            "max_s": max(self.samples),
            "reps": len(self.samples),
            "calls_per_rep": self.number,
        }


@dataclasses.dataclass
class Comparison:
    """Timings of several alternatives measured in one interleaved run."""

    baseline: str
    timings: dict[str, Timing]

    def ok(self, name: str) -> bool:
        """Whether `name` was timed (it exists and did not fail)."""
        timing = self.timings.get(name)
        return timing is not None and timing.error is None and bool(timing.samples)

    def median(self, name: str) -> float:
        """Median seconds per call of `name`."""
        return _quantiles(self.timings[name].samples)[1]

    def ratio(self, name: str, reference: str | None = None) -> dict[str, float] | None:
        """Time of `name` over time of `reference` (default: the baseline), paired per repetition.

        Each repetition ran every alternative back to back, so the ratio within a repetition
        cancels slow drifts of the machine's load; the median and quartiles are over
        repetitions. None if either side was not timed.
        """
        reference = self.baseline if reference is None else reference
        if not (self.ok(name) and self.ok(reference)):
            return None
        pairs = zip(self.timings[name].samples, self.timings[reference].samples, strict=True)
        q1, median, q3 = _quantiles([a / b for a, b in pairs])
        return {"median": median, "q1": q1, "q3": q3}

    def difference(self, name: str, reference: str) -> dict[str, float] | None:
        """Seconds per call of `name` minus those of `reference`, paired per repetition as in
        `ratio`; None if either side was not timed."""
        if not (self.ok(name) and self.ok(reference)):
            return None
        pairs = zip(self.timings[name].samples, self.timings[reference].samples, strict=True)
        q1, median, q3 = _quantiles([a - b for a, b in pairs])
        return {"median": median, "q1": q1, "q3": q3}


@dataclasses.dataclass(frozen=True)
class TimingPolicy:
    """How long to measure.

    Attributes:
      reps: repetitions wanted per alternative.
      min_reps: repetitions kept even when `budget_s` would allow fewer.
      warmup: untimed calls per alternative before timing (the first one compiles).
      min_sample_s: a repetition calls an alternative enough times to last at least this long.
      budget_s: a comparison's timed part is cut to fewer repetitions (not below `min_reps`) to
        fit in about this many seconds.
    """

    reps: int
    min_reps: int
    warmup: int
    min_sample_s: float
    budget_s: float


#: The ~2-minute run (`--quick`) and the full run.
QUICK = TimingPolicy(reps=5, min_reps=2, warmup=1, min_sample_s=0.02, budget_s=3.0)
FULL = TimingPolicy(reps=11, min_reps=3, warmup=1, min_sample_s=0.05, budget_s=12.0)


def compare(
    alternatives: Mapping[str, Callable[[], Any] | str],
    *,
    baseline: str,
    policy: TimingPolicy,
) -> Comparison:
    """Times the alternatives interleaved: A B C, then B C A, ... one sample each per repetition.

    After the warm-up, one calibration call of each alternative (in order, A B C) sets how
    many calls a sample makes; when every alternative needs just one, that calibration pass is
    the first repetition. The number of repetitions fits `policy.budget_s`.

    Args:
      alternatives: name -> a callable doing one unit of work and returning its results, or a
        string saying why that alternative could not be built (it is reported, not timed).
      baseline: the name ratios are relative to.
      policy: repetitions, warm-up and sample length.

    Returns:
      The timings; an alternative that raised while warming up or timing keeps the error.
    """
    if baseline not in alternatives:
        raise ValueError(f"baseline {baseline!r} is not one of {sorted(alternatives)}")
    timings = {name: Timing() for name in alternatives}
    runnable: dict[str, Callable[[], Any]] = {}
    for name, fn in alternatives.items():
        if isinstance(fn, str):
            timings[name].error = fn
            continue
        try:
            for _ in range(policy.warmup):
                sync(fn())
        except Exception as err:  # An alternative's failure is a result to report.
            timings[name].error = f"{type(err).__name__}: {err}"
            continue
        runnable[name] = fn
    calibration = {}
    for name in list(runnable):
        seconds = _timed(timings[name], runnable, name, 1)
        if seconds is not None:
            calibration[name] = seconds
            timings[name].number = max(1, math.ceil(policy.min_sample_s / max(seconds, 1e-9)))
    per_rep = sum(timings[name].number * seconds for name, seconds in calibration.items())
    reps = policy.reps
    if per_rep > 0:
        reps = max(policy.min_reps, min(policy.reps, int(policy.budget_s / per_rep)))
    first = 0
    if all(timings[name].number == 1 for name in runnable):
        for name in runnable:
            timings[name].samples.append(calibration[name])
        first = 1
    names = list(runnable)
    for rep in range(first, reps):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in runnable:
                seconds = _timed(timings[name], runnable, name, timings[name].number)
                if seconds is not None:
                    timings[name].samples.append(seconds)
    return Comparison(baseline, timings)


def _timed(
    timing: Timing, runnable: dict[str, Callable[[], Any]], name: str, number: int
) -> float | None:
    """Mean synced seconds of `number` calls; on an exception, records it and drops `name`."""
    try:
        start = time.perf_counter()
        for _ in range(number):
            sync(runnable[name]())
        return (time.perf_counter() - start) / number
    except Exception as err:  # An alternative's failure is a result to report.
        timing.error = f"{type(err).__name__}: {err}"
        timing.samples.clear()
        del runnable[name]
        return None


def time_once(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of one call of `fn` until its results are synced, and those results.

    For what happens once: a first call (trace and compile), one trace.
    """
    start = time.perf_counter()
    result = fn()
    sync(result)
    return time.perf_counter() - start, result


def time_calls(fn: Callable[[], Any], calls: int) -> list[float]:
    """Seconds of each of `calls` synced calls of `fn`, one after another, none untimed.

    For a workload `compare` cannot interleave (a pipeline run, a collective in a torchrun
    worker); warm it up before.
    """
    return [time_once(fn)[0] for _ in range(calls)]


@dataclasses.dataclass
class Rounds:
    """What `rounds` measured.

    Attributes:
      seconds: alternative -> seconds of its call in each round, in round order.
      load_1min: the 1-minute load average at the start of each round.
    """

    seconds: dict[str, list[float]]
    load_1min: list[float]


def rounds(prepare: Mapping[str, Callable[[], Callable[[], Any]]], count: int) -> Rounds:
    """`count` rounds, each one synced call of every alternative in order (A B, A B, ...).

    Unlike `compare`: no warm-up, no calibration, one call per sample, the same order in each
    round, and the load average beside each round: for a few later calls after a first call
    timed on its own (`time_once`).

    Args:
      prepare: name -> a function that prepares one call, untimed (fresh inputs, say), and
        returns the zero-argument call to time.
      count: rounds.
    """
    result = Rounds({name: [] for name in prepare}, [])
    for _ in range(count):
        result.load_1min.append(os.getloadavg()[0])
        for name, make in prepare.items():
            result.seconds[name].append(time_once(make())[0])
    return result


def each(
    items: Sequence[_T],
    desc: str,
    measure: Callable[[_T], Any],
    label: Callable[[_T], str] = lambda item: item.row_id,
) -> None:
    """`measure(item)` for each item, under a progress bar `desc` showing `label(item)` (by
    default the item's `row_id`)."""
    with progress(len(items), desc) as bar:
        for item in items:
            bar.set_postfix_str(label(item))
            measure(item)
            bar.update()


_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def fresh_process(python: str, module: str, *args: str) -> list[str]:
    """The command that runs `python -m module *args` in a fresh process whose peak RSS is its
    own: Linux keeps ru_maxrss across fork and exec, so the child is started by a small launcher
    process, whose own small peak is all it inherits (see `peak_rss`)."""
    return [python, "-c", _LAUNCHER, python, "-m", module, *args]


def peak_rss(spec: Mapping[str, Any], *, calls: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Peak resident memory of a fresh Python process that builds and runs one workload.

    The child (`python -m benchmarks.workers.peak_rss`) imports the libraries, builds `spec` with
    `benchmarks.workloads.build`, runs it `calls` times (synced) and reports
    `resource.getrusage(RUSAGE_SELF).ru_maxrss`, before building and at the end.

    Linux keeps ru_maxrss across fork and exec, so a child forked from this (large) process
    would report at least our peak. The child is therefore started by a small launcher
    process, whose own small peak is all it inherits.

    Returns:
      {"peak_rss_mb", "import_rss_mb", "delta_rss_mb"} (plus "child_failed" if the child
      printed them but then exited with an error), or {"error": ...}.
    """
    command = fresh_process(
        sys.executable, "benchmarks.workers.peak_rss", json.dumps({**spec, "calls": calls})
    )
    try:
        done = subprocess.run(
            command,
            cwd=PACKAGE_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"child exited with {done.returncode}: {tail[0]}"}
    if done.returncode != 0:  # It measured, then failed (at exit): keep both facts.
        result["child_failed"] = f"exited with {done.returncode} after measuring: {tail[0]}"
    return result


@dataclasses.dataclass(frozen=True)
class Context:
    """Settings shared by the cases of one run.

    Attributes:
      quick: the ~2-minute run (fewer sizes and repetitions).
      policy: timing policy of each comparison.
      alternatives: federated cases: the alternatives to time.
      memory: peak-RSS child processes: "auto" (the rows each case picks for this mode),
        "all" rows or "none".
      models: federated cases: only these models (None: the case's own choice).
      clients: federated cases: these client counts instead of the case's own.
      xla: federated cases: add torch-xla rows where a torch-xla environment exists.
      round_alternatives: model-round cases ("cnn", "lm"): the alternatives asked for (None:
        all of `workloads.round_alternatives()`).
      device: the "accelerator" and "overhead" cases: where the tensors live, "cpu" or "cuda";
        "tpu": host tensors, programs on the chip (the "accelerator" case).
      rounds: the "accelerator" case: later rounds per alternative (None: the case's own).
      precisions: the "accelerator" case: torch's float32 matmul precisions to run each row at.
    """

    quick: bool
    policy: TimingPolicy
    alternatives: tuple[str, ...]
    memory: str = "auto"
    models: tuple[str, ...] | None = None
    clients: tuple[int, ...] | None = None
    xla: bool = True
    round_alternatives: tuple[str, ...] | None = None
    device: str = "cpu"
    rounds: int | None = None
    precisions: tuple[str, ...] = ("highest",)

    def wants_memory(self, auto: bool) -> bool:
        """Whether to measure peak RSS for a row the case would (`auto`) or would not pick."""
        return self.memory == "all" or (self.memory == "auto" and auto)


def progress(total: int, desc: str) -> Any:
    """A progress bar on stderr (tqdm) for `total` steps."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
