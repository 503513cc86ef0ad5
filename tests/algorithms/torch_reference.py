"""Pure-torch reference rounds (explicit loops over clients) and the shared small model."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Tensors = dict[str, torch.Tensor]
TorchLoss = Callable[[Mapping[str, torch.Tensor], Tensors], torch.Tensor]
InnerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def mse_loss(
    model: torch.nn.Module,
) -> Callable[[Mapping[str, torch.Tensor], Tensors], torch.Tensor]:
    def loss(params: Mapping[str, torch.Tensor], batch: Tensors) -> torch.Tensor:
        out = torch.func.functional_call(model, dict(params), (batch["x"],))
        return ((out - batch["y"]) ** 2).mean()

    return loss


def client_batches(clients: int, steps: int, batch: int = 6, seed: int = 1) -> Tensors:
    """Non-IID regression data shaped [clients, steps, batch, ...]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(clients, steps, batch, 4, generator=g)
    shift = torch.arange(clients, dtype=torch.float32).reshape(clients, 1, 1, 1) / clients
    y = torch.sin(x[..., :2] * 2 + shift) + 0.1 * torch.randn(clients, steps, batch, 2, generator=g)
    return {"x": x, "y": y}


def local_deltas(
    loss: TorchLoss,
    server: Mapping[str, torch.Tensor],
    batches: Tensors,
    inner: InnerFactory,
    *,
    prox_mu: float = 0.0,
) -> tuple[list[Tensors], list[torch.Tensor]]:
    """Each client's delta after its local steps (a fresh inner optimizer), and its mean loss."""
    clients, steps = next(iter(batches.values())).shape[:2]
    deltas, losses = [], []
    for c in range(clients):
        start = {k: v.detach().clone() for k, v in server.items()}
        w = {k: v.clone().requires_grad_(True) for k, v in start.items()}
        opt = inner(list(w.values()))
        values = []
        for h in range(steps):
            value = loss(w, {k: v[c, h] for k, v in batches.items()})
            if prox_mu:
                value = value + 0.5 * prox_mu * sum(((w[k] - start[k]) ** 2).sum() for k in w)
            opt.zero_grad()
            value.backward()
            opt.step()
            values.append(value.detach())
        deltas.append({k: w[k].detach() - start[k] for k in w})
        losses.append(torch.stack(values).mean())
    return deltas, losses


def weighted_mean(values: list[Tensors], weights: torch.Tensor | None) -> Tensors:
    w = torch.ones(len(values)) if weights is None else weights.to(torch.float32)
    return {k: sum(wi * v[k] for wi, v in zip(w, values, strict=True)) / w.sum() for k in values[0]}
