"""Shared setup for the dlpack tests.

Makes this folder's test data module (`dlpack_cases`) importable, and pins JAX's default device
to the first CPU device so the CPU tests mean the same on a machine whose JAX also has GPUs
(the CUDA tests place their arrays explicitly).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)


@pytest.fixture(autouse=True)
def _default_to_cpu() -> Iterator[None]:
    with jax.default_device(jax.devices("cpu")[0]):
        yield
