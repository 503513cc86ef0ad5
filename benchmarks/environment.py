"""Process setup and the facts printed with every run: XLA flags, machine, versions, load."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from importlib import metadata
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def machine() -> dict[str, Any]:
    """CPU, cores, memory, library versions, thread counts and XLA_FLAGS of this process."""
    import jax
    import torch

    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "jax_devices": [str(d) for d in jax.devices()],
        "drjax": _version("drjax"),
        "numpy": _version("numpy"),
        "bridge_mr_commit": _git_commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_cpu_async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch")),
    }


def _busy_cpu_seconds() -> float | None:
    """CPU-seconds all processes have spent busy since boot (from /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class LoadMeter:
    """Measures how busy *other* processes kept the CPUs while a block of benchmarking ran."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._busy = _busy_cpu_seconds()
        self._own = _own_cpu_seconds()

    def read(self, also_own_s: float = 0.0) -> dict[str, float | None]:
        """Wall seconds since creation and the average number of CPUs other processes used.

        `also_own_s`: CPU seconds of a process of ours that is still running (a worker serving
        rounds), which the busy time also leaves out.
        """
        wall = time.perf_counter() - self._wall
        busy = _busy_cpu_seconds()
        other = None
        if busy is not None and self._busy is not None and wall > 0:
            own = _own_cpu_seconds() - self._own + also_own_s
            other = max(0.0, (busy - self._busy) - own) / wall
        return {"wall_s": wall, "other_cpus_busy": other}


def describe(info: dict[str, Any]) -> str:
    """A few lines naming the machine and the settings, for the printed output."""
    return "\n".join(
        [
            f"machine: {info['cpu_model']}, {info['usable_cpus']} usable CPUs "
            f"({info['logical_cpus']} logical), {info['memory_gib']:.0f} GiB, {info['platform']}",
            f"python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), "
            f"jax {info['jax']} / jaxlib {info['jaxlib']} on {', '.join(info['jax_devices'])}, "
            f"drjax {info['drjax']}, numpy {info['numpy']}, bridge_mr @ {info['bridge_mr_commit']}",
            f"XLA_FLAGS={info['xla_flags']}; JAX CPU dispatch "
            f"{'asynchronous' if info['jax_cpu_async_dispatch'] else 'synchronous'}",
        ]
    )
