"""A federated dataset held as JAX arrays (`FederatedDataset.to(jax_device)`, data on the chip):
its rounds gather there, equal the torch dataset's rounds, and train to the same values."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch

import bridge_mr
from bridge_mr import algorithms as alg
from bridge_mr import data as fd


def _dataset() -> fd.FederatedDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    y = torch.randint(0, 3, (40,), generator=g)  # int64: int32 on the JAX device
    return fd.FederatedDataset.from_tensors({"x": x, "y": y}, fd.Dirichlet(6, 0.5, seed=0))


def _masked_loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    per_example = torch.nn.functional.cross_entropy(logits, batch["y"], reduction="none")
    mask = batch["mask"]
    return (mask * per_example).sum() / mask.sum().clamp(min=1.0)


def test_a_round_on_jax_arrays_equals_the_torch_round():
    train = _dataset()
    device = jax.devices("cpu")[0]
    on_jax = train.to(device)
    sampler = train.sampler(probability=0.6, generator=1)  # padding rows
    cohort = sampler.sample()
    expected = train.round(
        cohort, batch_size=3, epochs=2, generator=torch.Generator().manual_seed(2)
    )
    found = on_jax.round(cohort, batch_size=3, epochs=2, generator=torch.Generator().manual_seed(2))
    assert set(found.batches) == set(expected.batches)
    for name, value in found.batches.items():
        assert isinstance(value, jax.Array)
        assert value.devices() == {device}
        np.testing.assert_array_equal(np.asarray(value), expected.batches[name].numpy())
    assert found.batches["y"].dtype == np.int32
    torch.testing.assert_close(found.weights, expected.weights)  # host tensors
    torch.testing.assert_close(found.client_mask, expected.client_mask)
    np.testing.assert_array_equal(np.asarray(on_jax.client(2)["x"]), train.client(2)["x"].numpy())


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "auto"])
def test_fedavg_from_jax_resident_data_equals_the_torch_data(strategy):
    train = _dataset()
    on_jax = train.to(jax.devices("cpu")[0])
    local = alg.local_training(bridge_mr.from_torch(_masked_loss), optax.sgd(0.1), steps=2)
    grads = []
    for dataset in (train, on_jax):
        g = torch.Generator().manual_seed(3)
        params = {
            "w": torch.zeros(4, 3, requires_grad=True),
            "b": torch.zeros(3, requires_grad=True),
        }
        rnd = dataset.round(batch_size=4, steps=2, generator=g)
        alg.outer_step(local, params, rnd.batches, weights=rnd.weights, strategy=strategy)
        grads.append({k: p.grad for k, p in params.items()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-6, atol=1e-7)


def test_bfloat16_fields_and_dp_fedavg_without_a_mask():
    train = _dataset()
    half = fd.FederatedDataset({"x": train.examples["x"].bfloat16()}, train.offsets)
    on_jax = half.to(jax.devices("cpu")[0])
    np.testing.assert_array_equal(
        np.asarray(on_jax.examples["x"]).astype(np.float32), half.examples["x"].float().numpy()
    )
    local = alg.local_training(bridge_mr.from_torch(_masked_loss), optax.sgd(0.1), steps=2)
    rnd = train.to(jax.devices("cpu")[0]).round(batch_size=4, steps=2, generator=torch.Generator())
    params = {"w": torch.zeros(4, 3, requires_grad=True), "b": torch.zeros(3, requires_grad=True)}
    metrics = alg.dp_outer_step(
        local, params, rnd.batches, clip_norm=1e6, noise_multiplier=0.0, expected_clients=6,
        generator=torch.Generator().manual_seed(0), strategy="vmap",
    )  # fmt: skip
    assert float(metrics["clients"]) == 6


def test_unsigned_64_bit_fields_become_uint32_on_the_device():
    ids = torch.tensor([0, 0, 1, 1])  # already grouped by client: the order is kept
    y = torch.tensor([0, 1, 2, 2**32 - 1], dtype=torch.uint64)
    on_jax = fd.FederatedDataset.from_tensors({"y": y}, ids).to(jax.devices("cpu")[0])
    assert on_jax.examples["y"].dtype == np.uint32
    assert np.asarray(on_jax.examples["y"]).tolist() == [0, 1, 2, 2**32 - 1]


def test_fields_jax_cannot_hold_are_refused_with_the_fix():
    ids = torch.arange(4) % 2
    with pytest.raises(
        TypeError, match=r"field 'x' has dtype torch.float64.*\.to\(torch.float32\)"
    ):
        fd.FederatedDataset.from_tensors({"x": torch.zeros(4, dtype=torch.float64)}, ids).to(
            jax.devices("cpu")[0]
        )
    eight = torch.zeros(4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"field 'x': expected a tensor of a dtype JAX shares"):
        fd.FederatedDataset.from_tensors({"x": eight}, ids).to(jax.devices("cpu")[0])
    big = torch.tensor([0, 1, 2, 2**40])
    with pytest.raises(
        ValueError,
        match=r"field 'y': a torch.int64 tensor crosses to JAX as int32.*it holds 1099511627776",
    ):
        fd.FederatedDataset.from_tensors({"y": big}, ids).to(jax.devices("cpu")[0])
    with pytest.raises(
        ValueError,
        match=r"field 'y': a torch.uint64 tensor crosses to JAX as uint32.*it holds 1099511627776",
    ):
        fd.FederatedDataset.from_tensors({"y": big.to(torch.uint64)}, ids).to(jax.devices("cpu")[0])
    on_jax = fd.FederatedDataset.from_tensors({"x": torch.zeros(4)}, ids).to(jax.devices("cpu")[0])
    with pytest.raises(TypeError, match=r"the examples are JAX arrays; a torch device"):
        on_jax.to("cpu")
    with pytest.raises(TypeError, match=r"build it from tensors, then FederatedDataset.to"):
        fd.FederatedDataset.from_tensors(on_jax.examples, ids)
    elsewhere = jax.device_put(on_jax.examples["x"], jax.devices("cpu")[1])
    with pytest.raises(
        TypeError, match=r"'y': 'jax.Array on TFRT_CPU_1'|'y': 'jax.Array on cpu:1'"
    ):
        fd.FederatedDataset({"x": on_jax.examples["x"], "y": elsewhere}, torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match=r"every field a JAX array on one device, got"):
        fd.FederatedDataset(
            {"x": torch.zeros(4), "y": on_jax.examples["x"]}, torch.tensor([0, 2, 4])
        )


def test_fields_are_copied_so_later_changes_to_the_tensors_stay_out():
    # to_jax shares the tensor's memory; `to` copies it, and the copy has finished when `to`
    # returns: 8 MB fields, as the copies ran asynchronously, were reached by a change right
    # after `to` in about one try of five.
    for _ in range(20):
        examples = {"x": torch.zeros(2000, 1000)}
        dataset = fd.FederatedDataset.from_tensors(examples, torch.arange(2000) % 2)
        on_jax = dataset.to(jax.devices("cpu")[0])
        dataset.examples["x"] += 1.0
        assert float(np.abs(np.asarray(on_jax.examples["x"])).max()) == 0.0


@pytest.mark.parametrize("device", [0, 1])
def test_a_permuted_field_gathers_its_own_values(device):
    """Images stored NHWC and seen NCHW (a permuted tensor): its rounds on the JAX device, and
    a computation on them, equal the torch dataset's (jaxlib 0.10.2 computed on a permuted
    array's device_put copy as if row-major)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 6, 6, 3, generator=g).permute(0, 3, 1, 2)
    train = fd.FederatedDataset.from_tensors({"x": x}, fd.IID(4))
    on_jax = train.to(jax.devices("cpu")[device])
    want = train.round(batch_size=5, steps=1, generator=torch.Generator().manual_seed(1))
    found = on_jax.round(batch_size=5, steps=1, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(np.asarray(found.batches["x"]), want.batches["x"].numpy())
    doubled = jax.jit(lambda a: a[:, 2] * 2)(on_jax.examples["x"])
    np.testing.assert_array_equal(np.asarray(doubled), train.examples["x"][:, 2].numpy() * 2)
