"""FedSGD and FedAvg rounds on the XLA device: the CPU path's rounds, compiled once.

The training loops are plain torch around `bridge_mr.map_reduce` (public names only: the demo is
a leaf that tests through its own entry points).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close

import bridge_mr

pytestmark = pytest.mark.xla

# float32 on two XLA CPU builds (jaxlib's and torch-xla's): the last bits may differ.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
N_CLIENTS, N_FEATURES, N_CLASSES = 4, 16, 5

Params = dict[str, Any]
Tensors = dict[str, torch.Tensor]


def _client_loss(params: Params, batch: Params) -> jax.Array:
    """Cross-entropy of a 16-8-5 MLP on the client's batch {"x": [b, 16], "y": one-hot [b, 5]}."""
    hidden = jax.nn.relu(batch["x"] @ params["0.weight"].T + params["0.bias"])
    logits = hidden @ params["2.weight"].T + params["2.bias"]
    return -jnp.mean(jnp.sum(batch["y"] * jax.nn.log_softmax(logits), axis=-1))


def _local_sgd(params: Params, batches: Params, *, lr: float) -> dict[str, Any]:
    """SGD over the client's batches ([steps, b, ...]): {"delta": trained - params, "loss"}."""

    def step(current: Params, batch: Params) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(_client_loss)(current, batch)
        return jax.tree.map(lambda p, g: p - lr * g, current, grads), loss

    trained, losses = jax.lax.scan(step, params, batches)
    return {"delta": jax.tree.map(jnp.subtract, trained, params), "loss": losses.mean()}


LOCAL_SGD = functools.partial(_local_sgd, lr=0.3)  # One object: compiled once per signature.


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 8), torch.nn.ReLU(), torch.nn.Linear(8, N_CLASSES)
    )


def _batches(rounds: int, *, steps: int | None = None, batch: int = 6) -> Iterator[Tensors]:
    """Each round's fresh client data, [clients, (steps,) batch, ...], the same on every call.

    The labels are a fixed linear teacher's argmax: learnable, so training lowers the loss.
    """
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=gen)
    shape = (N_CLIENTS, *(() if steps is None else (steps,)), batch)
    for _ in range(rounds):
        x = torch.randn(*shape, N_FEATURES, generator=gen)
        labels = (x @ teacher).argmax(dim=-1)
        yield {"x": x, "y": torch.nn.functional.one_hot(labels, N_CLASSES).float()}


def _fedsgd(model: torch.nn.Module, device: Any, rounds: int) -> list[float]:
    """Rounds of FedSGD: the clients' mean loss, backward, a server Adam step."""
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for batch in _batches(rounds):
        optimizer.zero_grad()
        loss = bridge_mr.map_reduce(_client_loss, params, _to(batch, device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _fedavg(model: torch.nn.Module, device: Any, rounds: int) -> list[float]:
    """Rounds of FedAvg: the clients' mean local-SGD delta as the server SGD's pseudo-gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    for batches in _batches(rounds, steps=3):
        with torch.no_grad():
            update = bridge_mr.map_reduce(
                LOCAL_SGD, dict(model.named_parameters()), _to(batches, device)
            )
        for name, p in model.named_parameters():
            p.grad = -update["delta"][name]
        optimizer.step()
        losses.append(update["loss"].item())
    return losses


def _to(batch: Tensors, device: Any) -> Tensors:
    return {name: t.to(device) for name, t in batch.items()}


Train = Callable[[torch.nn.Module, Any, int], list[float]]


@pytest.mark.parametrize("train", [_fedsgd, _fedavg], ids=["FedSGD", "FedAvg"])
def test_rounds_on_xla_equal_the_cpu_path(xla: Any, train: Train) -> None:
    initial = _model()
    runs = []
    for device in ("cpu", xla.device()):
        model = copy.deepcopy(initial).to(device)
        losses = train(model, device, 3)
        runs.append((losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}))
    (cpu_losses, cpu_state), (xla_losses, xla_state) = runs
    assert_trees_all_close(xla_losses, cpu_losses, **TOLERANCE)
    assert_trees_all_close(xla_state, cpu_state, **TOLERANCE)


def test_a_50_step_training_loop_stops_compiling_after_warm_up(xla: Any) -> None:
    """FedSGD with Adam: forward, backward and the update form one graph per step after warm-up."""
    model = _model().to(xla.device())
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    compiles, losses = [], []
    xla.sync()
    xla.debug.metrics.clear_all()
    for batch in _batches(50):
        optimizer.zero_grad()
        loss = bridge_mr.map_reduce(_client_loss, params, _to(batch, xla.device()))
        loss.backward()
        optimizer.step()
        xla.sync()
        losses.append(loss.item())
        compiles.append(xla.debug.metrics.metric_data("CompileTime")[0])
    warm_up = 3
    assert compiles[warm_up - 1] <= warm_up
    assert compiles[-1] == compiles[warm_up - 1], compiles
    assert sum(losses[-5:]) < sum(losses[:5])
