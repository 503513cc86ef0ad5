"""The federated-learning demo: its data split, its JAX client functions and a --quick run."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch
from helpers import assert_trees_all_close

from bridge_mr import jax_core
from bridge_mr.demo import (
    MLP,
    TorchFuncClients,
    client_batches,
    client_loss,
    load_federated_digits,
    local_sgd,
)
from bridge_mr.demo.__main__ import QUICK_ROUNDS, main

ALGORITHMS = ("FedSGD", "FedAvg")


@pytest.fixture(scope="module")
def data():
    return load_federated_digits(16, seed=0)


def test_split_is_equal_sized_label_skewed_and_held_out(data):
    assert data.client_x.shape == (16, 88, 64)
    assert data.client_x.dtype == data.client_y.dtype == torch.float32
    assert data.client_y.shape == (16, 88, 10)
    assert torch.equal(data.client_y.sum(-1), torch.ones(16, 88))
    labels_per_client = [len(set(data.client_y[c].argmax(-1).tolist())) for c in range(16)]
    assert max(labels_per_client) <= 4, labels_per_client
    assert float(data.client_x.min()) >= 0.0
    assert float(data.client_x.max()) <= 1.0
    assert len(data.test_y) == 360
    assert set(data.test_y.tolist()) == set(range(10))
    again = load_federated_digits(16, seed=0)
    assert torch.equal(again.client_x, data.client_x)
    assert not torch.equal(load_federated_digits(16, seed=1).client_x, data.client_x)


@pytest.mark.parametrize("n_clients", [0, 719])
def test_impossible_client_counts_are_refused(n_clients):
    with pytest.raises(ValueError, match="n_clients must be between 1 and 718"):
        load_federated_digits(n_clients)


def test_batches_come_from_each_clients_own_shard(data):
    (batch,) = client_batches(data, rounds=1, batch_size=8, local_steps=3, seed=0)
    assert batch["x"].shape == (16, 3, 8, 64)
    assert batch["y"].shape == (16, 3, 8, 10)
    for client in range(16):
        shard = {tuple(row.tolist()) for row in data.client_x[client]}
        assert all(tuple(row.tolist()) in shard for row in batch["x"][client].reshape(-1, 64))
    with pytest.raises(ValueError, match="batch_size must be between 1 and the 88"):
        next(client_batches(data, rounds=1, batch_size=89))


def _to_jax(tree):
    return jax.tree.map(lambda t: jax.numpy.asarray(t.detach().numpy()), tree)


def test_jax_client_functions_match_torch_func_baseline(data):
    torch.manual_seed(0)
    model = MLP()
    params = {name: p.detach() for name, p in model.named_parameters()}
    baseline = TorchFuncClients(model, local_lr=0.3)
    (batch,) = client_batches(data, rounds=1, batch_size=32, seed=0)
    (batches,) = client_batches(data, rounds=1, batch_size=32, local_steps=4, seed=0)

    @functools.partial(jax.jit, static_argnums=0)
    @jax_core.program(placements={"clients": data.n_clients})
    def mean_over_clients(fn, server, clients):
        return jax_core.reduce_mean(jax_core.map_fn(fn, (jax_core.broadcast(server), clients)))

    def mean_loss(server, clients):
        return mean_over_clients(client_loss, server, clients)

    loss, grads = jax.value_and_grad(mean_loss)(_to_jax(params), _to_jax(batch))
    torch_params = {name: p.clone().requires_grad_() for name, p in params.items()}
    torch_loss = baseline.mean_loss(torch_params, batch)
    torch_grads = torch.autograd.grad(torch_loss, list(torch_params.values()))
    assert loss.dtype == np.float32
    assert_trees_all_close(loss, torch_loss, rtol=1e-5, atol=1e-6)
    assert_trees_all_close(
        grads, dict(zip(torch_params, torch_grads, strict=True)), rtol=1e-4, atol=1e-6
    )

    update = mean_over_clients(
        functools.partial(local_sgd, lr=0.3), _to_jax(params), _to_jax(batches)
    )
    assert_trees_all_close(update, baseline.mean_local_update(params, batches), atol=1e-5)


def test_quick_demo_trains_both_algorithms_like_the_baseline(capsys):
    result = main(["--quick"])
    out = capsys.readouterr().out
    assert "XLA_FLAGS=" in out
    assert "--xla_cpu_experimental_ynn_fusion_type=-reduce" in out
    for algorithm in ALGORITHMS:
        for name in ("bridge_mr", "torch.func"):
            run = result.phase(algorithm, name)
            assert len(run.losses) == QUICK_ROUNDS
            assert run.accuracy >= 0.75, (algorithm, name, run.accuracy)
            assert run.losses[-1] < 0.5 * run.losses[0]
            assert f"{algorithm:<9}  {name:<14}" in out
    # Same init, same data, same algorithm: FedSGD's trajectories agree to float32 rounding.
    # FedAvg's ten local steps a round amplify rounding differences, slowly.
    fedsgd, fedavg = ([result.phase(a, n) for n in ("bridge_mr", "torch.func")] for a in ALGORITHMS)
    np.testing.assert_allclose(fedsgd[0].losses, fedsgd[1].losses, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fedavg[0].losses[:5], fedavg[1].losses[:5], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fedavg[0].losses, fedavg[1].losses, atol=1e-2)
    assert abs(fedsgd[0].accuracy - fedsgd[1].accuracy) <= 1 / 360 + 1e-9
    assert "largest per-round difference" in out
