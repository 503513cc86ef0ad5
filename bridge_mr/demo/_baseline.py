"""The pure-torch baseline: the same client computations with `torch.func.vmap`."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ._train import LocalUpdate, Tensors


class TorchFuncClients:
    """Runs every client at once with `torch.func.vmap` over `functional_call` of `model`."""

    name = "torch.func"

    def __init__(self, model: nn.Module, *, local_lr: float) -> None:
        self._model = model
        self._local_lr = local_lr

    def _loss(self, params: dict[str, torch.Tensor], batch: Tensors) -> torch.Tensor:
        logits = functional_call(self._model, params, (batch["x"],))
        return -(batch["y"] * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()

    def _local_sgd(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        step_grad = grad_and_value(self._loss)
        current, losses = dict(params), []
        for step in range(batches["x"].shape[0]):
            grads, loss = step_grad(current, {name: b[step] for name, b in batches.items()})
            current = {name: p - self._local_lr * grads[name] for name, p in current.items()}
            losses.append(loss)
        delta = {name: current[name] - params[name] for name in params}
        return {"delta": delta, "loss": torch.stack(losses).mean()}

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to `params`."""
        return vmap(self._loss, in_dims=(None, 0))(dict(params), batch).mean()

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and mean local loss."""
        per_client = vmap(self._local_sgd, in_dims=(None, 0))(params, batches)
        delta = {name: d.mean(dim=0) for name, d in per_client["delta"].items()}
        return {"delta": delta, "loss": per_client["loss"].mean()}
