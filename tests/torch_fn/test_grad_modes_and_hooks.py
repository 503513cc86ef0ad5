"""`bridge_mr.from_torch`: `torch.no_grad` blocks and `.detach()` stop gradients as in torch,
the caller's `no_grad` does not reach inside, forward hooks run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.from_torch import close
from torch import nn

import bridge_mr

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


def test_no_grad_blocks_and_detach_stop_gradients_as_in_torch() -> None:
    def fn(w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = (w * 3).sum()
        return (w * target).sum() + (w * w.detach()).sum()

    w = torch.tensor([1.0, 2.0, -1.0], requires_grad=True)
    fn(w).backward()
    grad = jax.grad(bridge_mr.from_torch(fn))(jnp.asarray(w.detach().numpy()))
    close(grad, w.grad, "grad")


def test_the_callers_no_grad_does_not_reach_inside() -> None:
    fn = bridge_mr.from_torch(lambda w: (w * w).sum())
    with torch.no_grad():  # as FedAvg calls map_reduce: JAX's own gradients inside must flow
        grad = jax.grad(fn)(jnp.asarray([1.0, 2.0]))
    np.testing.assert_allclose(np.asarray(grad), [2.0, 4.0])


def test_forward_hooks_run() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.register_forward_hook(lambda m, args, out: out * 2)
    x = torch.randn(2, 4)
    converted = bridge_mr.from_torch(lambda s, x: torch.func.functional_call(model, s, (x,)))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    close(converted(params, jnp.asarray(x.numpy())), model(x), "hooked output")
