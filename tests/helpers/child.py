"""Scripts in fresh interpreters: for what is per process (imports, runtimes, global flags)."""

from __future__ import annotations

import os
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
