"""Fixtures for the torch-xla tests: the torch_xla module, and scripts run in fresh interpreters.

Imports nothing from torch_xla at collection time: the main environment collects these modules
too (and skips their `xla`-marked tests).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from helpers.child import run_python

_CPU_DEVICES = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


@pytest.fixture(scope="session")
def xla() -> Any:
    """torch_xla (with its metrics module loaded), imported only where it is installed."""
    import torch_xla
    import torch_xla.debug.metrics

    return torch_xla


@pytest.fixture(scope="session")
def child_cwd(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An empty directory for child interpreters to start in (no source tree on sys.path)."""
    return tmp_path_factory.mktemp("child")


@pytest.fixture(scope="session")
def child_stdout(child_cwd: Any) -> Callable[[Sequence[str]], str]:
    """Runs `python *args` in a fresh interpreter on the CPU PJRT device; returns its stdout.

    SPMD mode and the torch-xla runtime are per process, so tests that set them run there. The
    child starts in an empty directory and inherits the environment: it imports bridge_mr from
    PYTHONPATH when that is set, else the installed package. A non-zero exit fails the test.
    """
    return lambda args: run_python(args, cwd=child_cwd, env=_CPU_DEVICES)


@pytest.fixture(scope="session")
def run_child(child_cwd: Any) -> Callable[[str], Any]:
    """Runs a Python script in a fresh interpreter; returns the JSON of its last output line."""
    return lambda script: json.loads(
        run_python(["-c", script], cwd=child_cwd, env=_CPU_DEVICES).splitlines()[-1]
    )
