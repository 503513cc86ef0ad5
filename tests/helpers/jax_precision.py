"""Differential JAX tests in float32 (the default leg) and float64 (the x64 leg)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest


def float32_and_float64(float32: float, float64: float) -> pytest.MarkDecorator:
    """Parametrizes `dtype` (JAX's) and `close` (rtol and atol): float32, and float64 marked
    `x64` (it needs JAX's 64-bit mode: BRIDGE_MR_X64=1)."""
    return pytest.mark.parametrize(
        ("dtype", "close"),
        [
            (jnp.float32, {"rtol": float32, "atol": float32}),
            pytest.param(jnp.float64, {"rtol": float64, "atol": float64}, marks=pytest.mark.x64),
        ],
        ids=["float32", "float64"],
    )
