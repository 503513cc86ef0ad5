"""The demo's FedSGD and FedAvg on the XLA device: the CPU path's rounds, compiled once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import assert_trees_all_close

from bridge_mr.demo import (
    MLP,
    BridgeClients,
    FedAvgConfig,
    FederatedDigits,
    FedSGDConfig,
    client_batches,
    train_fedavg,
    train_fedsgd,
)

pytestmark = pytest.mark.xla

# float32 on two XLA CPU builds (jaxlib's and torch-xla's): the last bits may differ.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _data(n_clients: int = 4, per_client: int = 24) -> FederatedDigits:
    """Random 'digits': enough for the loops, no scikit-learn download."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n_clients, per_client), generator=gen)
    return FederatedDigits(
        client_x=torch.rand(n_clients, per_client, 64, generator=gen),
        client_y=torch.nn.functional.one_hot(labels, 10).float(),
        test_x=torch.rand(20, 64, generator=gen),
        test_y=torch.randint(0, 10, (20,), generator=gen),
    )


def _train_on_cpu_and_xla(xla: Any, train: Any, config: Any) -> list[tuple[Any, MLP]]:
    data = _data()
    torch.manual_seed(0)
    initial = MLP(hidden=16)
    runs = []
    for device in ("cpu", xla.device()):
        model = copy.deepcopy(initial).to(device)
        result = train(
            model, data.to(device), BridgeClients(local_lr=0.3), config, show_progress=False
        )
        runs.append((result, model))
    return runs


def test_fedsgd_rounds_on_xla_equal_the_cpu_path(xla: Any) -> None:
    config = FedSGDConfig(rounds=3, batch_size=8)
    (cpu, cpu_model), (on_xla, xla_model) = _train_on_cpu_and_xla(xla, train_fedsgd, config)
    assert_trees_all_close(on_xla.losses, cpu.losses, **TOLERANCE)
    assert_trees_all_close(xla_model.state_dict(), cpu_model.state_dict(), **TOLERANCE)
    assert on_xla.accuracy == cpu.accuracy


def test_fedavg_rounds_on_xla_equal_the_cpu_path(xla: Any) -> None:
    config = FedAvgConfig(rounds=3, local_steps=3, batch_size=8)
    (cpu, cpu_model), (on_xla, xla_model) = _train_on_cpu_and_xla(xla, train_fedavg, config)
    assert_trees_all_close(on_xla.losses, cpu.losses, **TOLERANCE)
    assert_trees_all_close(xla_model.state_dict(), cpu_model.state_dict(), **TOLERANCE)
    assert on_xla.accuracy == cpu.accuracy


def test_a_50_step_training_loop_stops_compiling_after_warm_up(xla: Any) -> None:
    """FedSGD with Adam: forward, backward and the update form one graph per step after warm-up."""
    data = _data().to(xla.device())
    torch.manual_seed(0)
    model = MLP(hidden=16).to(xla.device())
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    clients = BridgeClients(local_lr=0.3)
    compiles, losses = [], []
    xla.sync()
    xla.debug.metrics.clear_all()
    for batch in client_batches(data, rounds=50, batch_size=8, seed=0):
        optimizer.zero_grad()
        loss = clients.mean_loss(params, batch)
        loss.backward()
        optimizer.step()
        xla.sync()
        losses.append(loss.item())
        compiles.append(xla.debug.metrics.metric_data("CompileTime")[0])
    warm_up = 3
    assert compiles[warm_up - 1] <= warm_up
    assert compiles[-1] == compiles[warm_up - 1], compiles
    assert sum(losses[-5:]) < sum(losses[:5])
