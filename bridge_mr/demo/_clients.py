"""The clients as bridge_mr runs them: the torch loss, converted by `bridge_mr.from_torch`.

`bridge_mr.map_reduce(fn, server, clients)` takes JAX functions of (server parameters, one
client's data). FedSGD's is the converted torch loss itself; FedAvg's is a few lines of JAX glue
(`lax.scan` over `jax.value_and_grad` of it) for the clients' local SGD steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import torch
from torch import nn

import bridge_mr

from ._model import ModelClients
from ._train import LocalUpdate, Tensors

Arrays = dict[str, jax.Array]
Loss = Callable[[Arrays, Arrays], jax.Array]


class BridgeClients(ModelClients):
    """The clients' work as one JAX program per round, by `bridge_mr.map_reduce`."""

    name = "bridge_mr"

    def __init__(self, model: nn.Module, *, local_lr: float) -> None:
        super().__init__(model, local_lr=local_lr)
        # One function object each, made once: map_reduce traces once per (fn, signature).
        self._loss = bridge_mr.from_torch(self._torch_loss)
        self._local_sgd = functools.partial(_local_sgd, self._loss, lr=local_lr)

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to `params`."""
        return bridge_mr.map_reduce(self._loss, params, batch)

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and their mean local loss."""
        return bridge_mr.map_reduce(self._local_sgd, params, batches)


def _local_sgd(loss: Loss, params: Arrays, batches: Arrays, *, lr: float) -> dict[str, Any]:
    """Plain SGD on `loss` from `params` over one client's batches ([steps, b, ...]).

    Returns {"delta": trained - initial parameters, "loss": the mean loss over the steps}.
    """

    def step(current: Arrays, batch: Arrays) -> tuple[Arrays, jax.Array]:
        value, grads = jax.value_and_grad(loss)(current, batch)
        return {name: p - lr * grads[name] for name, p in current.items()}, value

    trained, losses = jax.lax.scan(step, params, batches)
    return {"delta": {name: trained[name] - params[name] for name in params}, "loss": losses.mean()}
