"""Hypergradients: a FedAvg round differentiated with respect to the client learning rate."""

from __future__ import annotations

from typing import Any

import pytest

# .venv-xla (the torch_xla leg, which selects none of these tests) has no optax.
optax = pytest.importorskip("optax", reason="needs the algorithms extra: pip install .[algorithms]")

import torch  # noqa: E402
from algorithms.torch_reference import Tensors, client_batches, mlp, mse_loss  # noqa: E402

import bridge_mr  # noqa: E402
from bridge_mr import algorithms as alg  # noqa: E402

STEPS = 3
CLIENTS = 4


def _torch_round_loss(
    model: torch.nn.Module, params: Tensors, batches: Tensors, held_out: Tensors, lr: torch.Tensor
) -> torch.Tensor:
    """The held-out loss after one FedAvg round (local SGD, mean delta), by torch autograd."""
    loss = mse_loss(model)
    deltas = []
    for c in range(CLIENTS):
        w = {k: p.clone().requires_grad_(True) for k, p in params.items()}
        for h in range(STEPS):
            value = loss(w, {k: v[c, h] for k, v in batches.items()})
            grads = torch.autograd.grad(value, list(w.values()), create_graph=True)
            w = {k: p - lr * g for (k, p), g in zip(w.items(), grads, strict=True)}
        deltas.append({k: w[k] - params[k] for k in w})
    new = {k: params[k] + sum(d[k] for d in deltas) / CLIENTS for k in params}
    return loss(new, held_out)


def _round_loss(
    local: alg.LocalTraining,
    model: torch.nn.Module,
    params: Tensors,
    batches: Tensors,
    held_out: Tensors,
    lr: torch.Tensor,
    strategy: Any = "vmap",
) -> torch.Tensor:
    delta, _ = alg.mean_delta(local, params, batches, hparams=lr, strategy=strategy)
    return mse_loss(model)({k: params[k] + delta[k] for k in params}, held_out)


def _setup() -> tuple[torch.nn.Module, Tensors, Tensors, Tensors, alg.LocalTraining]:
    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    batches = client_batches(CLIENTS, STEPS, seed=2)
    held_out = {k: v[0, 0] for k, v in client_batches(1, 1, batch=32, seed=9).items()}
    local = alg.local_training(
        bridge_mr.from_torch(mse_loss(model)), lambda lr: optax.sgd(lr), STEPS
    )
    return model, params, batches, held_out, local


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["vmap", "per_client"])
def test_the_learning_rate_gradient_equals_torch_autograd(strategy: str) -> None:
    model, params, batches, held_out, local = _setup()
    lr = torch.tensor(0.3, requires_grad=True)
    value = _round_loss(local, model, params, batches, held_out, lr, strategy)
    value.backward()
    ref_lr = torch.tensor(0.3, requires_grad=True)
    expected = _torch_round_loss(model, params, batches, held_out, ref_lr)
    expected.backward()
    torch.testing.assert_close(value.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert lr.grad is not None
    assert ref_lr.grad is not None
    assert ref_lr.grad.abs() > 1e-3  # A gradient that matters.
    torch.testing.assert_close(lr.grad, ref_lr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_torch_optimizer_tunes_the_client_learning_rate() -> None:
    model, params, batches, held_out, local = _setup()
    lr = torch.tensor(0.01, requires_grad=True)
    tuner = torch.optim.Adam([lr], lr=0.05)
    losses = []
    for _ in range(15):
        value = _round_loss(local, model, params, batches, held_out, lr)
        tuner.zero_grad()
        value.backward()
        tuner.step()
        losses.append(value.item())
    assert lr.item() > 0.1  # Tuned up from 0.01: a few local steps of 0.01 barely move.
    assert losses[-1] < 0.9 * losses[0]
    assert bridge_mr.trace_counts()["map_reduce"] > 0


def test_mean_delta_needs_hparams_for_a_factory() -> None:
    _, params, batches, _, local = _setup()
    with pytest.raises(ValueError, match=r"hparams=\.\.\.\): local's optimizer is a factory"):
        alg.mean_delta(local, params, batches)
