"""One small client loss, in JAX and in torch, for tests that compare the two."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def client_loss(params: Any, batch: Any) -> Any:
    """A tanh layer's squared error: params {"w": [out, in], "b": [out]}, batch {"x", "y"}."""
    hidden = jnp.tanh(batch["x"] @ params["w"].T + params["b"])
    return jnp.mean((hidden.sum(-1) - batch["y"]) ** 2)


def torch_client_loss(params: Any, x: Any, y: Any) -> Any:
    """`client_loss` in torch, on one client's tensors."""
    import torch

    hidden = torch.tanh(x @ params["w"].T + params["b"])
    return ((hidden.sum(-1) - y) ** 2).mean()
