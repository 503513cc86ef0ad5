"""A small map_reduce round on torch tensors, shared by the strategy and auto tests."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch


def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """One client's loss: a tanh layer's summed outputs against its targets."""
    hidden = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((hidden.sum(-1) - batch["y"]) ** 2)


def delta(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One client's update: a pytree output of the same shapes as the parameters."""
    return {"w": params["w"] * loss(params, batch), "b": params["b"]}


def case(n: int = 5, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """Parameters, `n` clients' data and positive weights, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    clients = {"x": torch.randn(n, 4, 3, generator=gen), "y": torch.randn(n, 4, generator=gen)}
    weights = torch.rand(n, generator=gen) + 0.5
    return params, clients, weights
