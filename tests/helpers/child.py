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

    The child inherits this process's environment, updated with `env`.
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
    assert child.returncode == 0, f"exit {child.returncode}:\n{child.stderr[-4000:]}"
    return child.stdout
