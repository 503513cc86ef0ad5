"""map_reduce passes the server value to the clients unbatched (map_fn of a broadcast)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.clients import client_loss, torch_client_loss
from helpers.jaxprs import live_shapes

import bridge_mr

N = 4


def _case():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 6, generator=gen), "b": torch.randn(5, generator=gen)}
    clients = {"x": torch.randn(N, 3, 6, generator=gen), "y": torch.randn(N, 3, generator=gen)}
    return params, clients


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_server_gradients_match_a_torch_loop(reduce):
    params, clients = _case()
    params = {k: v.requires_grad_() for k, v in params.items()}
    loss = bridge_mr.map_reduce(client_loss, params, clients, reduce=reduce, strategy="vmap")
    loss.backward()
    losses = torch.stack(
        [torch_client_loss(params, x, y) for x, y in zip(clients["x"], clients["y"], strict=True)]
    )
    expected = losses.sum() if reduce == "sum" else losses.mean()
    expected_grads = torch.autograd.grad(expected, list(params.values()))
    assert_trees_all_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert_trees_all_close(
        [p.grad for p in params.values()], list(expected_grads), rtol=1e-5, atol=1e-5
    )


def test_the_traced_program_has_no_per_client_copy_of_the_server():
    # With JAX arrays, map_reduce is the JAX program the torch call traces.
    params, clients = _case()
    server = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    data = {k: jnp.asarray(v.numpy()) for k, v in clients.items()}

    def loss(server):
        return bridge_mr.map_reduce(client_loss, server, data, strategy="vmap")

    shapes = set(live_shapes(jax.make_jaxpr(jax.grad(loss))(server).jaxpr))
    assert [v.shape for v in server.values() if (N, *v.shape) in shapes] == []
