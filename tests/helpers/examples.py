"""The example scripts (examples/*.py) as modules, for tests that call their functions."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextlib.contextmanager
def example_module(name: str) -> Iterator[ModuleType]:
    """examples/`name`.py imported as a module, registered in sys.modules while in use.

    Registered because dataclasses look their module up there.
    """
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
