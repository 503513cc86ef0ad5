"""The model: a small torch MLP, and the same network written in JAX over its parameter dict."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch import nn

from ._data import N_CLASSES, N_FEATURES

Params = dict[str, Any]


class MLP(nn.Module):
    """64 → hidden → 10 with a ReLU: logits for the ten digits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] for images [batch, 64]."""
        return self.fc2(torch.relu(self.fc1(x)))


def mlp_logits(params: Params, x: jax.Array) -> jax.Array:
    """`MLP.forward` in JAX, over the arrays of `dict(model.named_parameters())`."""
    hidden = jax.nn.relu(x @ params["fc1.weight"].T + params["fc1.bias"])
    return hidden @ params["fc2.weight"].T + params["fc2.bias"]


def cross_entropy(logits: jax.Array, one_hot: jax.Array) -> jax.Array:
    """Mean cross-entropy of `logits` against one-hot labels."""
    return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of `x` that `model` classifies as `labels`."""
    return (model(x).argmax(dim=-1) == labels).float().mean().item()
