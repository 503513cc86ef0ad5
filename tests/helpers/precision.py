"""One test at two precisions: float64 in the x64 leg, float32 in the default leg."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def precisions(*, float64: Any, float32: Any) -> list[Any]:
    """`pytest.mark.parametrize` values (dtype, tolerance) for a differential test.

    The float64 case is marked `x64` (it needs JAX's 64-bit mode), so it runs in the x64 leg
    (BRIDGE_MR_X64=1); the float32 case runs in the default leg. `float64` and `float32` are
    the tolerances each gets: a number, or whatever tuple the test unpacks.
    """
    return [
        pytest.param(torch.float64, float64, marks=pytest.mark.x64, id="float64"),
        pytest.param(torch.float32, float32, id="float32"),
    ]
