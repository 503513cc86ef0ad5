"""Scripts in fresh interpreters: for what is per process (imports, runtimes, global flags)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_python(
    args: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> str:
    """Runs `python *args` (this interpreter) and returns its stdout; a non-zero exit fails.

    The child inherits this process's environment, updated with `env`, and starts in `cwd`
    (this process's working directory when None). The failure names the exit status and the
    tails of the child's stdout and stderr.
    """
    child = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    stdout = f"stdout:\n{child.stdout[-2000:]}\n" if child.stdout else ""
    stderr = f"stderr:\n{child.stderr[-4000:]}"
    assert child.returncode == 0, f"exit {child.returncode}:\n{stdout}{stderr}"
    return child.stdout


def torchrun(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    processes: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """Runs `script` under `python -m torch.distributed.run` on a free port; returns the run.

    The exit status is the caller's to check (some tests expect a failure).
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            f"--master-port={port}",
            str(script),
            *args,
        ],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
