"""The model, written once in torch: an MLP, each client's loss, and the test accuracy.

Both client implementations run this torch code: the baseline with `torch.func`, bridge_mr as
JAX operations through `bridge_mr.from_torch`; both start from `ModelClients`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

N_FEATURES = 64  # digits' 8x8 pixels
N_CLASSES = 10


class MLP(nn.Module):
    """64 → hidden → 10 with a ReLU: logits for the ten digits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] for images [batch, 64]."""
        return self.fc2(torch.relu(self.fc1(x)))


def client_loss(
    model: nn.Module, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The mean cross-entropy of `model` with `params` on one client's batch.

    Args:
      model: the network (its own parameters are not used: `params` replace them).
      params: a tensor for each of `dict(model.named_parameters())`.
      batch: {"x": images [b, 64], "y": class indices [b] (int64)}.

    Returns:
      The scalar loss, differentiable with respect to `params`.

    Example::

        loss = client_loss(model, dict(model.named_parameters()), {"x": x, "y": y})
    """
    logits = functional_call(model, dict(params), (batch["x"],))
    return F.cross_entropy(logits, batch["y"])


class ModelClients:
    """What both client implementations start from: `client_loss` of `model`, and a local rate.

    Args:
      model: the torch network whose `client_loss` the clients compute.
      local_lr: the clients' SGD learning rate (FedAvg).
    """

    def __init__(self, model: nn.Module, *, local_lr: float) -> None:
        self._torch_loss = functools.partial(client_loss, model)
        self._local_lr = local_lr


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of `x` that `model` classifies as `labels`."""
    return (model(x).argmax(dim=-1) == labels).float().mean().item()
