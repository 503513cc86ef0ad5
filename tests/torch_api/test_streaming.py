"""Clients streamed in chunks (docs/strategies.md): reduce="sum" per chunk equals one weighted
mean."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from helpers import assert_trees_all_close

import bridge_mr


def _client_loss(params: dict[str, Any], client: dict[str, Any]) -> jax.Array:
    logits = client["x"] @ params["w"] + params["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), client["y"][:, None], 1))


def _weighted_loss(params: dict[str, Any], client: dict[str, Any]) -> jax.Array:
    return client["w"] * _client_loss(params, client)


def test_chunks_summed_then_divided_equal_one_weighted_mean() -> None:
    g = torch.Generator().manual_seed(0)
    n = 10
    clients = {
        "x": torch.randn(n, 6, 4, generator=g),
        "y": torch.randint(3, (n, 6), generator=g),
        "w": torch.rand(n, generator=g) + 0.5,
    }
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)}
    params = {k: v.requires_grad_() for k, v in params.items()}
    data = [{k: v[i] for k, v in clients.items()} for i in range(n)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # chunks of 4, 4 and 2 clients

    total, total_weight = 0.0, 0.0
    for chunk in loader:
        loss_sum = bridge_mr.map_reduce(_weighted_loss, params, chunk, reduce="sum")
        loss_sum.backward()
        total += loss_sum.item()
        total_weight += chunk["w"].sum().item()
    streamed = (total / total_weight, {k: p.grad / total_weight for k, p in params.items()})

    whole = bridge_mr.map_reduce(
        _client_loss,
        params,
        {"x": clients["x"], "y": clients["y"]},
        reduce="weighted_mean",
        weights=clients["w"],
    )
    grads = torch.autograd.grad(whole, list(params.values()))
    expected = (whole.item(), dict(zip(params, grads, strict=True)))
    assert_trees_all_close(streamed, expected, rtol=1e-5, atol=1e-6)
