"""Where a tiny `map_reduce` call's time goes, host tensors with the program on the device.

    python -m benchmarks.studies.profile_call [--device tpu] [--calls N] [--reps N] [--top N]

The call is the "accelerator" case's tiny row (one `map_reduce` forward + backward of the
overhead case's MLP, 4 clients, width 8; `workloads.accelerator.tiny_call`). Contestants, timed
interleaved in one process (`--reps` rounds of `--calls` calls each, the 1-minute load average
per round), each call waiting for its gradients:

* "bridge_mr": the torch call (host tensors; on a TPU host its programs run on the chip);
* "pure_jax": `jax.jit(jax.value_and_grad(...))` on arrays already on the device;
* "pure_jax_transfers": the same program as a pure-JAX user with host data writes it: the
  parameters and data go to the device (`jax.device_put`) and the gradients come back to numpy
  (`jax.device_get`, which starts every copy before it waits for one) on every call. Issue
  41's target compares bridge_mr's call with this one.

Then bridge_mr's calls run once more under `cProfile`: the functions with the most own time
and the most time including callees (`--top` each), and the calls per call of the functions
that cross to or wait for the device. Each result is printed as a JSON line as it comes, then
the profile's tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.workloads import accelerator as acc

#: Functions whose calls per call the profile reports: crossings and waits.
CROSSINGS = ("device_put", "block_until_ready", "_single_device_array_to_np_array", "is_ready")


def pure_jax_transfers(cfg: acc.AcceleratorConfig) -> Callable[[], Any]:
    """The tiny call in pure JAX from host numpy arrays, the gradients back in numpy."""
    import jax

    params, data = acc._tiny_numpy(cfg)
    data = {k: v.astype(np.int32) if v.dtype == np.int64 else v for k, v in data.items()}
    value_and_grad = jax.jit(jax.value_and_grad(acc._tiny_program(cfg)))
    device = acc._jax_device(cfg.device)
    precision = acc.JAX_PRECISION[cfg.precision]

    def call() -> Any:
        with jax.default_matmul_precision(precision):
            _, grads = value_and_grad(jax.device_put(params, device), jax.device_put(data, device))
        return jax.device_get(grads)

    return call


def contestants(cfg: acc.AcceleratorConfig) -> dict[str, Callable[[], Any]]:
    """Each contestant's call, waiting for its gradients."""
    import jax

    bridge = acc.tiny_call(cfg, "bridge_mr")
    pure = acc.tiny_call(cfg, "pure_jax")

    def pure_jax() -> Any:
        return jax.block_until_ready(pure())

    return {
        "bridge_mr": bridge,
        "pure_jax": pure_jax,
        "pure_jax_transfers": pure_jax_transfers(cfg),
    }


def time_interleaved(calls: dict[str, Callable[[], Any]], n: int, reps: int) -> dict[str, Any]:
    """Per contestant: the first call, then the median µs per call over `reps` rounds of `n`."""
    first = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        first[name] = (time.perf_counter() - start) * 1e6
        print(json.dumps({"event": "first", "name": name, "us": round(first[name], 1)}), flush=True)
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            call = calls[name]
            start = time.perf_counter()
            for _ in range(n):
                call()
            us = (time.perf_counter() - start) / n * 1e6
            per_call[name].append(us)
            load = os.getloadavg()[0]
            print(
                json.dumps({"event": "rep", "name": name, "us": round(us, 1), "load": load}),
                flush=True,
            )
    return {
        name: {"first_us": first[name], "median_us": statistics.median(v), "reps_us": v}
        for name, v in per_call.items()
    }


def profile(call: Callable[[], Any], n: int, top: int) -> str:
    """`n` calls under cProfile: the top functions by own and by cumulative time, per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    total = stats.total_tt  # type: ignore[attr-defined]
    out.write(f"cProfile of {n} calls: {total / n * 1e6:.1f} µs per call under the profiler\n")
    counts = []
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (file, line, name), (_, calls, _, cumulative, _) in raw.items():
        if any(name == c or name.endswith(c) for c in CROSSINGS):
            counts.append(
                f"  {name} ({os.path.basename(file)}:{line}): {calls / n:.2f} per call, "
                f"{cumulative / n * 1e6:.1f} µs per call with callees"
            )
    out.write("crossings and waits:\n" + "\n".join(sorted(counts)) + "\n")
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "tpu", "cuda"))
    parser.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    import torch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(args.precision)
    try:
        cfg = acc.AcceleratorConfig(
            "tiny", 4, steps=1, device=args.device, precision=args.precision
        )
        calls = contestants(cfg)
        times = time_interleaved(calls, args.calls, args.reps)
        floor = times["pure_jax_transfers"]["median_us"]
        for name, row in times.items():
            print(
                json.dumps(
                    {
                        "event": "median",
                        "name": name,
                        "us": round(row["median_us"], 1),
                        "over_pure_jax_transfers_us": round(row["median_us"] - floor, 1),
                        "first_us": round(row["first_us"], 1),
                    }
                ),
                flush=True,
            )
        print(profile(calls["bridge_mr"], args.calls, args.top), flush=True)
    finally:
        torch.set_float32_matmul_precision(previous)


if __name__ == "__main__":
    main()
