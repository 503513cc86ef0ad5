"""The benchmarks package (not installed) imported from the project root, for these tests."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def workloads(pytestconfig: pytest.Config) -> ModuleType:
    """`benchmarks.workloads`, imported with the project root on sys.path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(pytestconfig.rootpath))
        return importlib.import_module("benchmarks.workloads")
