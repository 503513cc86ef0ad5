"""Per-tensor cost of moving tensors between torch and JAX: bridge_mr vs public DLPack vs copies.

Run from the repository root:

    python -m benchmarks.bench_dlpack [--quick] [--device cpu|cuda] [--tensors N]

Each path converts the same batch of N small tensors; the paths run interleaved, each
repetition timing a fixed number of batch conversions, and the table reports per tensor the
median and minimum wall time and the median thread CPU time over repetitions.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from bridge_mr import dlpack

Path = Callable[[], Any]


def _import_paths(tensors: list[torch.Tensor], device: str) -> dict[str, Path]:
    paths: dict[str, Path] = {
        "bridge_mr.import_tensors": lambda: dlpack.import_tensors(tensors),
        "jax.dlpack.from_dlpack": lambda: [jax.dlpack.from_dlpack(t) for t in tensors],
    }
    if device == "cpu":
        paths["copy: jax.device_put(t.numpy())"] = lambda: [
            jax.device_put(t.numpy()) for t in tensors
        ]
    else:
        paths["copy: jax.device_put(t.cpu().numpy())"] = lambda: [
            jax.device_put(t.cpu().numpy(), jax.devices("gpu")[0]) for t in tensors
        ]
    return paths


def _export_paths(arrays: list[jax.Array]) -> dict[str, Path]:
    return {
        "bridge_mr.export_arrays": lambda: dlpack.export_arrays(arrays),
        "torch.from_dlpack": lambda: [torch.from_dlpack(a) for a in arrays],
        "copy: torch.tensor(np.asarray(a))": lambda: [torch.tensor(np.asarray(a)) for a in arrays],
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(
    paths: dict[str, Path], n_tensors: int, calls: int, repetitions: int, device: str
) -> dict[str, tuple[list[float], list[float]]]:
    """Per-tensor wall and thread-CPU microseconds of each path, one entry per repetition.

    The paths run interleaved so that load from other processes hits them alike; thread CPU
    time is the steadier number on a shared machine.
    """
    for path in paths.values():  # warm-up: compile, allocate, fill caches
        for _ in range(3):
            path()
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in paths}
    scale = 1e6 / (calls * n_tensors)
    for _ in range(repetitions):
        for name, path in paths.items():
            _sync(device)
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                path()
            _sync(device)
            samples[name][0].append((time.perf_counter() - wall) * scale)
            samples[name][1].append((time.thread_time() - cpu) * scale)
    return samples


def _report(title: str, samples: dict[str, tuple[list[float], list[float]]], public: str) -> None:
    baseline = statistics.median(samples[public][0])
    print(f"\n{title}")
    print(f"  {'path':40s} {'median us':>10s} {'min us':>8s} {'cpu us':>8s} {'vs public':>10s}")
    for name, (wall, cpu) in samples.items():
        median = statistics.median(wall)
        print(
            f"  {name:40s} {median:10.2f} {min(wall):8.2f} {statistics.median(cpu):8.2f} "
            f"{median / baseline:9.2f}x"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (~10 s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tensors", type=int, default=32, help="tensors per batch")
    args = parser.parse_args(argv)
    calls, repetitions = (20, 7) if args.quick else (100, 15)

    torch_device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tensors = [torch.randn(16, 16, device=torch_device) for _ in range(args.tensors)]
    arrays = [jax.jit(lambda x: x + 1)(a) for a in dlpack.import_tensors(tensors)]

    print(f"bridge_mr.dlpack benchmark: {args.tensors} tensors of float32[16, 16] on {args.device}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, jax {jax.__version__}, "
        f"jax devices: {jax.devices()[0].platform} x {jax.device_count()}, "
        f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}"
    )
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(
        f"{repetitions} repetitions x {calls} batch calls; microseconds per tensor: median and "
        f"min wall time, median thread CPU time"
    )
    n, device = len(tensors), args.device
    imports = _measure(_import_paths(tensors, device), n, calls, repetitions, device)
    _report("import torch -> JAX", imports, public="jax.dlpack.from_dlpack")
    exports = _measure(_export_paths(arrays), n, calls, repetitions, device)
    _report("export JAX -> torch", exports, public="torch.from_dlpack")


if __name__ == "__main__":
    main(sys.argv[1:])
