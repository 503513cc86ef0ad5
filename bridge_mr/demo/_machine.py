"""How busy the machine's other processes were while the demo timed its rounds (Linux)."""

from __future__ import annotations

import os
import time
from pathlib import Path

_PROC_STAT = Path("/proc/stat")


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process has used since boot (user, nice, system, irq, softirq, steal).

    None where /proc/stat does not exist (not Linux).
    """
    try:
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads, user and system)."""
    times = os.times()
    return times.user + times.system


class OtherProcessesCPU:
    """Starts counting when made; `cores()` is the other processes' mean CPU use since, in cores.

    Example:
      >>> others = OtherProcessesCPU()
      >>> busy = sum(range(10**6))  # the timed work
      >>> others.cores() >= 0  # e.g. 0.04: the rest of the machine was quiet
      True
    """

    def __init__(self) -> None:
        self._busy = _busy_cpu_seconds()
        self._own = _own_cpu_seconds()
        self._start = time.perf_counter()

    def cores(self) -> float | None:
        """The other processes' CPU seconds per second since this was made; None if unknown."""
        busy = _busy_cpu_seconds()
        if busy is None or self._busy is None:
            return None
        wall = time.perf_counter() - self._start
        others = (busy - self._busy) - (_own_cpu_seconds() - self._own)
        # Tick rounding can leave a few negative hundredths on a quiet machine.
        return max(others, 0.0) / wall if wall > 0 else 0.0
