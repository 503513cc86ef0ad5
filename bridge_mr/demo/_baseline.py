"""The pure-torch baselines, on the same torch model and client loss as bridge_mr's clients.

`TorchFuncClients` runs every client at once with `torch.func.vmap`; `TorchLoopClients` is the
loop a torch user writes: one client after the other, an `nn.Module` and a `torch.optim`
optimizer, `loss.backward()` and `optimizer.step()`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value, vmap

from ._model import ModelClients
from ._train import LocalUpdate, Tensors


class TorchFuncClients(ModelClients):
    """Runs every client at once with `torch.func.vmap` over `client_loss` of `model`."""

    name = "torch.func"

    def _local_sgd(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        step_grad = grad_and_value(self._torch_loss)
        current, losses = dict(params), []
        for step in range(batches["x"].shape[0]):
            grads, loss = step_grad(current, {name: b[step] for name, b in batches.items()})
            current = {name: p - self._local_lr * grads[name] for name, p in current.items()}
            losses.append(loss)
        delta = {name: current[name] - params[name] for name in params}
        return {"delta": delta, "loss": torch.stack(losses).mean()}

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to `params`."""
        return vmap(self._torch_loss, in_dims=(None, 0))(dict(params), batch).mean()

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and mean local loss."""
        per_client = vmap(self._local_sgd, in_dims=(None, 0))(params, batches)
        delta = {name: d.mean(dim=0) for name, d in per_client["delta"].items()}
        return {"delta": delta, "loss": per_client["loss"].mean()}


class TorchLoopClients(ModelClients):
    """A Python loop over clients, each running `model` (an `nn.Module`) and `torch.optim.SGD`.

    FedSGD calls `model` itself on each client's batch: the `params` it is given must be the
    model's own parameters (as `fedsgd_step` passes them). FedAvg trains one local copy of the
    model, reloaded from `params` for each client.
    """

    name = "torch loop"

    def __init__(self, model: nn.Module, *, local_lr: float) -> None:
        super().__init__(model, local_lr=local_lr)
        self._model = model
        self._local = copy.deepcopy(model)
        self._local_optimizer = torch.optim.SGD(self._local.parameters(), lr=local_lr)

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to the model's parameters."""
        losses = [
            F.cross_entropy(self._model(x), y) for x, y in zip(batch["x"], batch["y"], strict=True)
        ]
        return torch.stack(losses).mean()

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and mean local loss, one client at a time."""
        local, optimizer = self._local, self._local_optimizer
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        losses = []
        with torch.enable_grad():  # The server's round runs under no_grad.
            for client_x, client_y in zip(batches["x"], batches["y"], strict=True):
                local.load_state_dict(params)
                for x, y in zip(client_x, client_y, strict=True):
                    optimizer.zero_grad()
                    loss = F.cross_entropy(local(x), y)
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.detach())
                with torch.no_grad():
                    for name, p in local.named_parameters():
                        total[name] += p - params[name]
        n_clients = len(batches["x"])
        delta = {name: t / n_clients for name, t in total.items()}
        return {"delta": delta, "loss": torch.stack(losses).mean()}
