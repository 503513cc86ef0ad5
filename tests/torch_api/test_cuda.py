"""The torch frontend on CUDA tensors: same values and gradients as on CPU, results on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.precision import precisions

import bridge_mr

pytestmark = pytest.mark.cuda  # Skipped without a GPU (tests/conftest.py).


def _client_loss(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return jnp.mean((logits - y) ** 2)


def _inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(5, 8, generator=gen, dtype=dtype),
        "w2": torch.randn(8, 2, generator=gen, dtype=dtype),
    }
    data = (
        torch.randn(6, 4, 5, generator=gen, dtype=dtype),
        torch.randn(6, 4, 2, generator=gen, dtype=dtype),
    )
    params = {k: v.to(device).requires_grad_() for k, v in params.items()}
    return params, tuple(d.to(device) for d in data)


@pytest.mark.parametrize(("dtype", "tol"), precisions(float64=1e-10, float32=1e-5))
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_map_reduce_on_cuda_matches_cpu(reduce, dtype, tol):
    # float32 matmuls at full precision on both devices (JAX's GPU default may use TF32), so
    # CPU and CUDA agree to float32 rounding.
    results = {}
    for device in ("cpu", "cuda"):
        params, data = _inputs(device, dtype)
        with jax.default_matmul_precision("highest"):
            loss = bridge_mr.map_reduce(_client_loss, params, data, reduce=reduce)
            loss.backward()
        assert loss.device.type == device
        assert all(p.grad.device.type == device for p in params.values())
        results[device] = (loss.detach(), {k: p.grad for k, p in params.items()})
    assert_trees_all_close(results["cuda"], results["cpu"], rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), precisions(float64=1e-10, float32=1e-5))
def test_torch_function_on_cuda_keeps_the_device_and_grads(dtype, tol):
    fn = bridge_mr.torch_function(lambda a, b: (jnp.sin(a) * b).sum())
    a = torch.randn(16, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(16, device="cuda", dtype=dtype)
    out = fn(a, b)
    out.backward()
    assert out.device.type == "cuda"
    torch.testing.assert_close(a.grad, torch.cos(a.detach()) * b, rtol=tol, atol=tol)
