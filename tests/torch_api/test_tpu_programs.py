"""What the frontend compiles for a TPU, checked on the CPU: a program of host tensors whose
device is a TPU (stood in for by the CPU's second device, its platform read as "tpu") has its
grouped convolutions rewritten as batched matrix products (jax_core.matmul_convolutions), with
the values and gradients of a plain torch loop. On the chip itself: tests/tpu."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax
from jax.extend import core as jax_core_ext

import bridge_mr
from bridge_mr import jax_core
from bridge_mr.torch_api import _function, _traced


def _client(w: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Two local steps of a convolution (per-client kernels after the first), then a loss."""

    def loss(k: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.tanh(lax.conv(x, k, (1, 1), "SAME")) ** 2)

    k = w
    for x in batch["x"]:
        k = k - 0.5 * jax.grad(loss)(k, x)
    return loss(k, batch["x"][0])


def _torch_client(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    def loss(k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.conv2d(x, k, padding=1)).pow(2).mean()

    k = w
    for x in xs:
        (g,) = torch.autograd.grad(loss(k, x), k, create_graph=True)
        k = k - 0.5 * g
    return loss(k, xs[0])


def _grouped(jaxpr: Any) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            count += eqn.params["feature_group_count"] * eqn.params["batch_group_count"] > 1
        count += sum(_grouped(sub) for sub in jax_core_ext.jaxprs_in_params(eqn.params))
    return count


@pytest.fixture
def tpu_program(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Host tensors' programs on "a TPU"; collects the grouped convolutions of each program
    traced after the frontend's rewrite."""
    seen: list[int] = []
    rewrite = jax_core.matmul_convolutions

    def spied(fn: Any) -> Any:
        rewritten = rewrite(fn)

        def run(*args: Any) -> Any:
            seen.append(_grouped(jax.make_jaxpr(rewritten)(*args).jaxpr))
            return rewritten(*args)

        return run

    monkeypatch.setattr(_function, "host_program_device", lambda: jax.devices("cpu")[1])
    monkeypatch.setattr(_traced, "_platform", lambda spec: "tpu")
    monkeypatch.setattr(jax_core, "matmul_convolutions", spied)
    bridge_mr.clear_caches()
    yield seen
    bridge_mr.clear_caches()


def test_a_tpus_round_runs_its_grouped_convolutions_as_matrix_products(tpu_program):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(8, 3, 3, 3, generator=g) / 4).requires_grad_()
    xs = torch.randn(6, 2, 2, 3, 7, 7, generator=g)  # 6 clients, 2 steps of 2 images
    loss = bridge_mr.map_reduce(_client, w, {"x": xs}, strategy="vmap")
    loss.backward()
    assert tpu_program, "the frontend did not rewrite the program for the TPU"
    assert set(tpu_program) == {0}  # forward and backward: no grouped convolution left
    want_w = w.detach().double().requires_grad_()
    want = torch.stack([_torch_client(want_w, x) for x in xs.double()]).mean()
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    assert w.grad is not None
    torch.testing.assert_close(w.grad.double(), want_w.grad, rtol=1e-5, atol=1e-6)
