"""`benchmark(name)`: a module of the benchmarks (not installed), for tests/benchmarks/ only.

The benchmarks are run from the repository root, which is not on the tests' `sys.path`; this
puts it there while the module is imported (its own imports run then; later imports inside its
functions are relative, which needs no path). `tests/test_architecture.py` checks that no test
outside tests/benchmarks/ imports the benchmarks, this helper included.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

#: The repository root, which holds `benchmarks/`.
ROOT = Path(__file__).resolve().parents[2]


def benchmark(name: str = "") -> ModuleType:
    """`benchmarks.<name>` (e.g. "cases.data", "workloads", "__main__"; "" for the package)."""
    root = str(ROOT)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(f"benchmarks.{name}" if name else "benchmarks")
    finally:
        if added:
            sys.path.remove(root)
