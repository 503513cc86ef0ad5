"""Importing an optional library's modules by name, with one error that says how to install it.

By name (`importlib`): an optional library is installed in some environments only, so the type
checker (run in the main one) need not resolve it. Imports only the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

__all__ = ["import_modules"]


def import_modules(names: Sequence[str], failure: str) -> list[ModuleType]:
    """The modules `names`, imported.

    Args:
      names: dotted module names.
      failure: the ImportError's message; `{error}` in it is replaced by the original error.

    Returns:
      The modules, in the order of `names`.

    Raises:
      ImportError: one of them is not importable (chained from the original error).
    """
    try:
        return [importlib.import_module(name) for name in names]
    except ImportError as error:
        raise ImportError(failure.format(error=error)) from error
