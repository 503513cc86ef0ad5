"""FedAvg, DP-FedAvg and chunked rounds from bridge_mr.data's padded rounds, against torch loops
over the real, unpadded client data: padding slots and rows change no value and no gradient."""

from __future__ import annotations

from collections.abc import Mapping

import optax
import pytest
import torch

import bridge_mr
from bridge_mr import algorithms as alg
from bridge_mr import data as fd

COUNTS = [2, 5, 3, 6, 4]  # unequal clients
LR = 0.1
Tensors = dict[str, torch.Tensor]


def _dataset() -> fd.FederatedDataset:
    g = torch.Generator().manual_seed(0)
    n = sum(COUNTS)
    x = torch.randn(n, 4, generator=g)
    y = torch.randn(n, 2, generator=g)
    ids = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    return fd.FederatedDataset.from_tensors({"x": x, "y": y}, ids[torch.randperm(n, generator=g)])


def _per_example(params: Mapping[str, torch.Tensor], batch: Tensors) -> torch.Tensor:
    return ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).mean(-1)


def masked_loss(params: Mapping[str, torch.Tensor], batch: Tensors) -> torch.Tensor:
    """The mean loss over the batch's real examples (0 for a batch of padding only)."""
    mask = batch["mask"]
    return (mask * _per_example(params, batch)).sum() / mask.sum().clamp(min=1.0)


LOSS = bridge_mr.from_torch(masked_loss)


def _params() -> Tensors:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(4, 2, generator=g).requires_grad_(True),
        "b": torch.zeros(2).requires_grad_(True),
    }


def _client_delta(params: Tensors, steps: list[Tensors]) -> Tensors:
    """Plain SGD over `steps` (real examples only; an empty step is skipped), differentiably."""
    current = dict(params)
    for batch in steps:
        if len(batch["x"]) == 0:
            continue
        value = _per_example(current, batch).mean()
        grads = torch.autograd.grad(value, list(current.values()), create_graph=True)
        current = {k: v - LR * g for (k, v), g in zip(current.items(), grads, strict=True)}
    return {k: current[k] - params[k] for k in params}


def _reference(params: Tensors, train: fd.FederatedDataset, rnd: fd.Round) -> Tensors:
    """The weighted mean delta by a torch loop over the round's real clients and examples."""
    deltas, weights = [], []
    for row, client in enumerate(rnd.cohort.indices.tolist()):
        mask = rnd.batches["mask"][row] > 0
        steps = [
            {k: rnd.batches[k][row, s][mask[s]] for k in ("x", "y")} for s in range(mask.shape[0])
        ]
        deltas.append(_client_delta(params, steps))
        weights.append(float(train.example_counts[client]))
    total = sum(weights)
    return {k: sum(w * d[k] for w, d in zip(weights, deltas, strict=True)) / total for k in params}


def test_padded_round_is_the_unpadded_one_values_and_gradients() -> None:
    """Full-batch: a client's whole, unpadded data in step 0; step 1 and 2 padding rows."""
    train = _dataset()
    cohort = alg.Cohort(torch.tensor([0, 2, 3]), padded_size=4)  # Poisson-style padding row
    rnd = train.round(cohort, batch_size=6, steps=2, generator=torch.Generator().manual_seed(3))
    local = alg.local_training(LOSS, optax.sgd(LR), steps=2)
    params = _params()
    delta, _ = alg.mean_delta(local, params, rnd.batches, weights=rnd.weights, strategy="vmap")
    # The reference straight from each client's own tensors, no round involved.
    expected_deltas = [_client_delta(params, [train.client(c)]) for c in cohort.indices.tolist()]
    counts = [float(c) for c in train.example_counts[cohort.indices]]
    expected = {
        k: sum(n * d[k] for n, d in zip(counts, expected_deltas, strict=True)) / sum(counts)
        for k in params
    }
    probe = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
        for k, v in params.items()
    }
    for k in params:
        torch.testing.assert_close(delta[k], expected[k], rtol=1e-5, atol=1e-6)
    ours = torch.autograd.grad(
        sum((delta[k] * probe[k]).sum() for k in params), list(params.values())
    )
    theirs = torch.autograd.grad(
        sum((expected[k] * probe[k]).sum() for k in params), list(params.values())
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["vmap", "chunks"])
def test_outer_step_on_partial_batches_and_epochs(strategy: str) -> None:
    """Batches smaller than the clients, two epochs: partial batches and padding steps."""
    train = _dataset()
    sampler = train.sampler(probability=0.6, generator=4)
    cohort = sampler.sample()
    assert cohort.padded_size > cohort.size >= 2  # padding rows, and something to average
    rnd = train.round(cohort, batch_size=4, epochs=2, generator=torch.Generator().manual_seed(5))
    steps = rnd.batches["x"].shape[1]
    assert steps == 3  # ceil(2 * 6 / 4)
    local = alg.local_training(LOSS, optax.sgd(LR), steps=steps)
    params = _params()
    chunks = {"chunk_size": 3} if strategy == "chunks" else {}
    alg.outer_step(local, params, rnd.batches, weights=rnd.weights, strategy=strategy, **chunks)
    expected = _reference(params, train, rnd)
    for k, p in params.items():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, -expected[k].detach(), rtol=1e-5, atol=1e-6)


def test_dp_fedavg_from_a_poisson_round() -> None:
    train = _dataset()
    sampler = train.sampler(probability=0.5, generator=1)  # 3 clients, padded to 4
    cohort = sampler.sample()
    assert cohort.padded_size > cohort.size >= 1
    rnd = train.round(cohort, batch_size=3, steps=2, generator=torch.Generator().manual_seed(6))
    local = alg.local_training(LOSS, optax.sgd(LR), steps=2)
    params = _params()
    metrics = alg.dp_outer_step(
        local,
        params,
        rnd.batches,
        clip_norm=1e6,  # no client is clipped, and no noise: the plain sum over the real rows
        noise_multiplier=0.0,
        expected_clients=sampler.expected_cohort_size,
        generator=torch.Generator().manual_seed(0),
        mask=rnd.client_mask,
        strategy="vmap",
    )
    assert float(metrics["clients"]) == cohort.size
    deltas = []
    for row in range(cohort.size):
        mask = rnd.batches["mask"][row] > 0
        steps = [{k: rnd.batches[k][row, s][mask[s]] for k in ("x", "y")} for s in range(2)]
        deltas.append(_client_delta(params, steps))
    for k, p in params.items():
        expected = sum(d[k] for d in deltas) / sampler.expected_cohort_size
        assert p.grad is not None
        torch.testing.assert_close(p.grad, -expected.detach(), rtol=1e-5, atol=1e-6)
