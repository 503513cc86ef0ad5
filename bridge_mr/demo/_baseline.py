"""The pure-torch baseline: the same torch client loss, over all clients by `torch.func.vmap`."""

from __future__ import annotations

import torch
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
