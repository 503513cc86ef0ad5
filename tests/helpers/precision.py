"""One test at two precisions (float64 in the x64 leg, float32 in the default leg), and gradients
compared leaf by leaf."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
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


def _float64(leaf: Any) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().double()
    return torch.from_numpy(np.array(leaf, np.float64))


def leaf_errors(
    got: Mapping[str, Any], want: Mapping[str, Any], *, floor: float = 1e-3
) -> dict[str, float]:
    """Per leaf, ||got - want|| / max(||want||, `floor` x the largest leaf's norm), in float64.

    The floor keeps leaves that are zero in exact arithmetic (both sides then hold only
    rounding) from dividing by nothing; `floor=0` measures every leaf against its own norm.
    `got`'s leaves may be torch tensors or JAX / numpy arrays.
    """
    assert set(got) == set(want), f"leaves differ: {sorted(got)} vs {sorted(want)}"
    norms = {k: float(_float64(w).norm()) for k, w in want.items()}
    least = floor * max(norms.values())
    return {
        k: float((_float64(got[k]) - _float64(w)).norm()) / max(norms[k], least)
        for k, w in want.items()
    }


def assert_leaves_close(
    got: Mapping[str, Any], want: Mapping[str, Any], rtol: float, what: str = ""
) -> None:
    """Every leaf within `rtol` by `leaf_errors` (the default floor); names the leaves beyond."""
    worse = {k: f"{e:.3g}" for k, e in leaf_errors(got, want).items() if e > rtol}
    assert not worse, (
        f"{what} leaves beyond {rtol} (relative to max(||want||, 1e-3 x the largest)): {worse}"
    )


def torch_value_and_grads(
    loss: Callable[..., torch.Tensor],
    params: Mapping[str, torch.Tensor],
    data: Mapping[str, torch.Tensor],
) -> tuple[float, dict[str, torch.Tensor]]:
    """float64 torch autograd of `loss(params, data)`: its value and the gradient of every float
    leaf of both (integer leaves go in as they are)."""
    leaves = {
        k: v.detach().double().requires_grad_() if v.is_floating_point() else v
        for k, v in {**params, **data}.items()
    }
    value = loss({k: leaves[k] for k in params}, {k: leaves[k] for k in data})
    value.backward()
    return value.item(), {k: v.grad for k, v in leaves.items() if v.is_floating_point()}  # type: ignore[misc]
