"""On a TPU: host torch tensors run on the chip, at the precision torch's setting asks for.

Runs in the TPU leg only (`BRIDGE_MR_TPU=1 pytest -m tpu`, scripts/tpu_check.sh), where JAX holds
the chip; skipped elsewhere. Every check compares values and gradients with a float64 torch loop
on the host, within the precision in force: at torch's default "highest" float32 products are
exact float32; at "medium" they are one bfloat16 pass, whose error a CPU never shows (that is
how these tests see that the chip ran the program).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import chip
from helpers.precision import leaf_errors, torch_value_and_grads
from jax import lax

import bridge_mr
from bridge_mr import jax_core

pytestmark = pytest.mark.tpu

_STRATEGIES = [
    ("vmap", None),
    ("per_client", None),
    ("chunks", 4),
    ("packed", 2),
    ("auto", None),
]


@pytest.fixture(autouse=True)
def _torch_precision_restored() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_the_chip_is_where_host_tensors_run() -> None:
    device = bridge_mr.dlpack.host_program_device()
    assert device is not None
    assert device.platform == "tpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert bridge_mr.dlpack.host_program_device() is None


def test_large_images_cross_to_the_chip_as_dense_arrays_and_keep_their_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Images [clients, batch, 3, 32, 32] of 1.6 MB cross as [size / 1024, 1024]
    (`runners._dlpack.crossing_shape`) and are reshaped on the chip, and their gradient comes
    back so: the loss and gradients, the images' included, equal a float64 torch loop's, also
    for a permuted tensor. A rational
    function, not tanh: the chip's tanh put these gradients 4.4e-5 from float64's, with the
    dense crossing and without it alike (2026-12-07)."""

    def client(server: dict[str, Any], batch: dict[str, Any]) -> Any:
        s = jnp.sum(batch["x"] * server["w"], axis=(1, 2, 3)) / 32
        return jnp.mean(s / (1 + s * s))

    def torch_loss(server: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        s = (batch["x"] * server["w"]).sum(dim=(2, 3, 4)) / 32
        return (s / (1 + s * s)).mean()

    crossed = chip.crossed_shapes(monkeypatch)
    g = torch.Generator().manual_seed(0)
    server = {"w": torch.randn(3, 32, 32, generator=g)}
    for images in (
        torch.randn(8, 16, 3, 32, 32, generator=g),
        torch.randn(8, 16, 32, 32, 3, generator=g).permute(0, 1, 4, 2, 3),
    ):
        want_value, want = torch_value_and_grads(torch_loss, server, {"x": images})
        leaves = {"w": server["w"].clone().requires_grad_(), "x": images.clone().requires_grad_()}
        crossed.clear()
        loss = bridge_mr.map_reduce(client, {"w": leaves["w"]}, {"x": leaves["x"]})
        loss.backward()
        # The images going, their gradient coming back.
        assert crossed.count((8 * 16 * 3 * 32 * 32 // 1024, 1024)) == 2, crossed
        assert abs(loss.item() - want_value) <= 1e-5 * abs(want_value)
        errors = leaf_errors({k: v.grad for k, v in leaves.items()}, want)
        assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize(("strategy", "chunk_size"), _STRATEGIES)
def test_host_tensors_on_the_chip_equal_torch_at_highest(strategy: str, chunk_size: Any) -> None:
    chip.check_equal_torch_at_highest("cpu", strategy=strategy, chunk_size=chunk_size)


def test_torch_precision_setting_governs_and_takes_effect_between_calls() -> None:
    chip.check_precision_governs("cpu")


def test_the_cpu_stays_available_with_jax_default_device() -> None:
    server, batch = chip.matmul_case()
    _, want = torch_value_and_grads(chip.torch_matmul_loss, server, batch)
    torch.set_float32_matmul_precision("medium")  # Irrelevant on the CPU: exact float32.
    with jax.default_device(jax.devices("cpu")[0]):
        _, grads = chip.bridge_value_and_grads(server, batch, "cpu", strategy="vmap")
    assert max(leaf_errors(grads, want).values()) <= 1e-5


def test_from_torch_cnn_with_batchnorm_on_the_chip() -> None:
    case = chip.cnn_batchnorm_case()
    leaves = {k: v.clone().requires_grad_() for k, v in case.params.items()}
    server = case.server(leaves, case.buffers)
    loss, new_state = bridge_mr.map_reduce(case.client, server, case.data)
    loss.backward()
    assert abs(loss.item() - case.want_value) <= 1e-4 * abs(case.want_value)
    errors = leaf_errors({k: v.grad for k, v in leaves.items()}, case.want)
    assert max(errors.values()) <= 1e-4, errors
    # The running statistics come back, averaged over the clients, on the host.
    assert new_state["bn.running_mean"].device.type == "cpu"
    assert not torch.equal(new_state["bn.running_mean"], case.buffers["bn.running_mean"])


def test_from_torch_gpt2_on_the_chip() -> None:
    pytest.importorskip("transformers")
    case = chip.gpt2_case()
    leaves = {k: v.clone().requires_grad_() for k, v in case.params.items()}
    loss = bridge_mr.map_reduce(case.client, case.server(leaves, case.buffers), case.data)
    loss.backward()
    assert abs(loss.item() - case.want_value) <= 1e-4 * abs(case.want_value)
    errors = leaf_errors({k: v.grad for k, v in leaves.items()}, case.want)
    assert max(errors.values()) <= 1e-3, errors


def test_a_fedavg_round_on_the_chip_equals_the_cpu() -> None:
    """`algorithms.local_training` (4 local SGD steps per client) on the chip and on the CPU."""
    optax = pytest.importorskip("optax")
    server, batch = chip.matmul_case()
    steps = {k: v.reshape(12, 4, 8, *v.shape[2:]) for k, v in batch.items()}

    def local(params: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        h = b["x"] @ params["w1"]
        return F.mse_loss((h / (1 + h * h)) @ params["w2"], b["y"])

    train = bridge_mr.algorithms.local_training(
        bridge_mr.from_torch(local), optax.sgd(0.1), steps=4
    )
    on_chip, _ = bridge_mr.algorithms.mean_delta(train, server, steps)
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu, _ = bridge_mr.algorithms.mean_delta(train, server, steps)
    assert all(v.device.type == "cpu" for v in on_chip.values())
    errors = leaf_errors(on_chip, on_cpu)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize(("strategy", "chunk_size"), _STRATEGIES)
def test_client_data_on_the_chip(strategy: str, chunk_size: Any) -> None:
    """A dataset held on the chip (`FederatedDataset.to`): its round gathers there, only the
    parameters cross, and FedAvg's gradients equal those of the same round from host tensors."""
    optax = pytest.importorskip("optax")
    server, batch = chip.matmul_case()
    ids = torch.arange(12 * 32) % 12
    examples = {k: v.reshape(12 * 32, *v.shape[2:]) for k, v in batch.items()}
    train = bridge_mr.data.FederatedDataset.from_tensors(examples, ids)
    tpu = bridge_mr.dlpack.host_program_device()
    on_chip = train.to(tpu)

    def local(params: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        h = b["x"] @ params["w1"]
        return F.mse_loss((h / (1 + h * h)) @ params["w2"], b["y"])

    steps = bridge_mr.algorithms.local_training(
        bridge_mr.from_torch(local), optax.sgd(0.1), steps=4
    )
    grads = []
    for dataset in (train, on_chip):
        rnd = dataset.round(batch_size=8, steps=4, generator=torch.Generator().manual_seed(0))
        params = {k: v.clone().requires_grad_() for k, v in server.items()}
        options = {"strategy": strategy, "chunk_size": chunk_size}
        with bridge_mr.dlpack.count_conversions() as counts:
            bridge_mr.algorithms.outer_step(steps, params, rnd.batches, **options)
        grads.append({k: v.grad for k, v in params.items()})
    assert all(v.devices() == {tpu} for v in rnd.batches.values())
    assert counts.imports <= len(server), counts  # the parameters only
    errors = leaf_errors(grads[1], grads[0])
    assert max(errors.values()) <= 1e-5, errors


def _cnn_round_case() -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """8 clients, 3 local steps of 4 images: conv 3->16, conv 16->32, linear."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )
    params = {k: v.detach() for k, v in net.named_parameters()}
    g = torch.Generator().manual_seed(1)
    data = {"x": torch.randn(8, 3, 4, 3, 8, 8, generator=g), "y": torch.randint(0, 10, (8, 3, 4))}
    return net, params, data


@pytest.mark.parametrize(
    ("strategy", "chunk_size"), [("vmap", None), ("packed", 2), ("packed", 3), ("auto", None)]
)
def test_per_client_convolutions_on_the_chip_equal_the_cpu(strategy: str, chunk_size: Any) -> None:
    """A FedAvg round of a from_torch CNN (per-client kernels after the first local step, which
    vmap groups and "packed" runs as dense block-diagonal convolutions, at "highest" the
    images' convolution and its kernel's gradient as products of patches; auto picks "packed"
    there): on the chip, at "highest", the CPU's values."""
    optax = pytest.importorskip("optax")
    net, params, data = _cnn_round_case()

    def local(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(net, p, (b["x"],)), b["y"])

    train = bridge_mr.algorithms.local_training(
        bridge_mr.from_torch(local), optax.sgd(0.1), steps=3
    )
    on_chip, _ = bridge_mr.algorithms.mean_delta(
        train, params, data, strategy=strategy, chunk_size=chunk_size
    )
    if strategy == "auto":
        assert bridge_mr.map_reduce_choices()[-1].strategy == "packed"
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu, _ = bridge_mr.algorithms.mean_delta(train, params, data, strategy="per_client")
    errors = leaf_errors(on_chip, on_cpu)
    assert max(errors.values()) <= 1e-5, errors


def test_grouped_convolutions_rewritten_on_the_chip_equal_xlas() -> None:
    """jax_core.matmul_convolutions on the chip: the values of XLA:TPU's own grouped
    convolutions (which it compiles without `feature_group_count`) at "highest"."""

    def client(w: jax.Array, x: jax.Array) -> jax.Array:
        def loss(k: jax.Array) -> jax.Array:
            return jnp.mean(jax.lax.conv(x, k, (1, 1), "SAME") ** 2)

        for _ in range(2):  # The second step's kernel is the client's own.
            w = w - 0.1 * jax.grad(loss)(w)
        return w

    round_ = jax.vmap(client, (None, 0))
    w = jax.random.normal(jax.random.key(0), (32, 16, 3, 3)) / 12
    xs = jax.random.normal(jax.random.key(1), (8, 4, 16, 14, 14))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(round_)(w, xs)
        got = jax.jit(bridge_mr.jax_core.matmul_convolutions(round_))(w, xs)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5


def test_packed_max_pools_on_the_chip_choose_as_xlas_windows() -> None:
    """On the chip the packed strategy's max-pool and its gradient are a reshape and a max
    (jax_core._windows): they choose, ties and NaNs included, what XLA's window operations
    choose there (vmap's). Small integers: every product and sum is exact at any precision."""
    rng = np.random.default_rng(0)
    clients, numbers = 4, ("NCHW", "OIHW", "NCHW")
    x = jnp.asarray(rng.integers(-2, 3, (clients, 2, 3, 8, 8)), jnp.float32)
    kernels = jnp.asarray(rng.integers(-1, 2, (clients, 8, 3, 3, 3)), jnp.float32)
    nans = np.zeros((clients, 2, 8, 8, 8), np.float32)
    nans[rng.random(nans.shape) < 0.05] = np.nan
    cotangent = jnp.asarray(rng.integers(-3, 4, (clients, 2, 8, 4, 4)), jnp.float32)

    def client(k: Any, x: Any, nan: Any, ct: Any) -> Any:
        h = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=numbers) + nan

        def pool(h: Any) -> Any:
            return lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

        y, back = jax.vjp(pool, h)
        return y, back(ct)[0]

    args = (kernels, x, jnp.asarray(nans), cotangent)
    want = jax.jit(jax.vmap(client))(*args)
    got = jax.jit(jax_core.vmap_packed(client, clients))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), strict=True)
