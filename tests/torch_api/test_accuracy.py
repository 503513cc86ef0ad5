"""float32 gradients of conv nets with BatchNorm and GroupNorm through `map_reduce`, every
strategy, as accurate as torch float32's own: both measured against float64 torch.

On CPU these programs compile without YNNPACK's fusions, where XLA sums each reduction in one
sequential float32 accumulator; bridge_mr rewrites the large sums into levels of small ones
(`jax_core.cpu_program`). Without that, at these sizes, the worst leaf was 1.7x (the GroupNorm
net) and 6x (the BatchNorm net) torch's largest per-leaf error; with it 0.25x and 0.8-1.2x.

The measure: per leaf, ||g - g64|| / ||g64||. Two float32 computations round independently, so
on one leaf the ratio of their errors swings between 0.1x and 3x from seed to seed and leaf to
leaf (both are a few units of float32 rounding: benchmarks/results/NOTES.md, 2026-12-04); so
each leaf's error is bounded by 1.5x torch's largest per-leaf error on the same net, a bound the
sequential sums fail on 7 of these 8 cases.
Activations are smooth (GELU, SiLU), so no ReLU kink decides the comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.precision import leaf_errors
from torch import nn

import bridge_mr

CLIENTS, BATCH, SIZE = 4, 8, 24
BOUND = 1.5


def _conv_group_norm() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.GroupNorm(4, 8),
        nn.GELU(),
        nn.Conv2d(8, 8, 3),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def _conv_batch_norm_gelu() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),
        nn.BatchNorm2d(8, track_running_stats=False),
        nn.GELU(),
        nn.Conv2d(8, 8, 3, bias=False),
        nn.BatchNorm2d(8, track_running_stats=False),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


NETS: dict[str, Callable[[], nn.Module]] = {
    "conv_group_norm": _conv_group_norm,
    "conv_batch_norm_gelu": _conv_batch_norm_gelu,
}


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "chunks", "auto"])
@pytest.mark.parametrize("name", list(NETS))
def test_float32_gradients_are_as_accurate_as_torch_float32(name: str, strategy: str) -> None:
    torch.manual_seed(0)
    model = NETS[name]()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(CLIENTS, BATCH, 3, SIZE, SIZE, generator=g)
    y = torch.randint(0, 5, (CLIENTS, BATCH), generator=g)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    def torch_gradients(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        params = {k: v.detach().to(dtype).requires_grad_() for k, v in model.named_parameters()}
        mean = sum(loss(params, x[c].to(dtype), y[c]) for c in range(CLIENTS)) / CLIENTS
        assert isinstance(mean, torch.Tensor)
        mean.backward()
        return {k: p.grad.double() for k, p in params.items() if p.grad is not None}

    reference = torch_gradients(torch.float64)
    torch_error = max(leaf_errors(torch_gradients(torch.float32), reference, floor=0).values())

    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    converted = bridge_mr.from_torch(loss)
    chunks = {"chunk_size": 2} if strategy == "chunks" else {}
    bridge_mr.map_reduce(
        lambda p, d: converted(p, *d), params, (x, y), strategy=strategy, **chunks
    ).backward()
    got = {k: p.grad for k, p in params.items() if p.grad is not None}
    worse = {
        k: f"{e:.1e}"
        for k, e in leaf_errors(got, reference, floor=0).items()
        if e > BOUND * torch_error
    }
    assert not worse, f"leaves above {BOUND} x torch float32's {torch_error:.1e}: {worse}"
