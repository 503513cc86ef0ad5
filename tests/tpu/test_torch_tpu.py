"""On a TPU held by TorchTPU: "tpu" tensors' rounds run on the chip and stay there.

Runs in the TorchTPU leg only (`BRIDGE_MR_TORCH_TPU=1 pytest -m torch_tpu`, scripts/tpu_check.sh
with torch_tpu installed), where JAX is kept to the CPU (`JAX_PLATFORMS=cpu`) and only traces
and exports; skipped elsewhere. Values and gradients are compared, on the host, with a float64
torch loop within the precision in force (as tests/tpu/test_tpu.py does for host tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import jax
import pytest
import torch
import torch.nn.functional as F
from helpers import chip
from helpers.precision import leaf_errors

import bridge_mr

pytestmark = pytest.mark.torch_tpu

#: torch's float32 matmul precision as this module is imported: TorchTPU's setting when it loads
#: (read without torch 2.9's warning at each read: the torch-xla leg collects this module too).
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Please use the new API settings", UserWarning)
    _PRECISION_AT_IMPORT = torch.get_float32_matmul_precision()

# TorchTPU 0.2.0's `.item()` of a tensor that requires grad warns that a non-leaf's `.grad` is
# read (plain torch ops' results too): the tests read values `.detach()`ed.

_STRATEGIES = [("vmap", None), ("per_client", None), ("chunks", 4), ("auto", None)]


@pytest.fixture(autouse=True)
def _at_highest_precision() -> Iterator[None]:
    """Each test at torch's "highest" float32 matmul precision (TorchTPU sets "medium" when it
    loads; bridge_mr follows torch's setting, as TorchTPU's own ops do), restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def test_torch_tpu_sets_medium_precision_and_bridge_mr_follows() -> None:
    """What a TorchTPU user gets without asking: TorchTPU's "medium" (one bfloat16 pass), for
    bridge_mr's programs as for TorchTPU's own matmuls."""
    assert _PRECISION_AT_IMPORT == "medium"
    torch.set_float32_matmul_precision(_PRECISION_AT_IMPORT)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g) / 20
    want = x.double() @ w.double()
    own = (x.to("tpu") @ w.to("tpu")).cpu()
    ours = bridge_mr.torch_function(lambda a, b: a @ b)(x.to("tpu"), w.to("tpu")).cpu()
    errors = [leaf_errors({"y": y}, {"y": want})["y"] for y in (own, ours)]
    assert all(1e-4 < e < 1e-2 for e in errors), errors


def _tpu(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("tpu") for k, v in tree.items()}


def _host(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in tree.items()}


def test_jax_stays_on_the_cpu_beside_torch_tpu() -> None:
    assert jax.default_backend() == "cpu"
    assert torch.tensor([1.0]).to("tpu").device.type == "tpu"


@pytest.mark.parametrize(("strategy", "chunk_size"), _STRATEGIES)
def test_tpu_tensors_equal_torch_at_highest(strategy: str, chunk_size: Any) -> None:
    chip.check_equal_torch_at_highest("tpu", strategy=strategy, chunk_size=chunk_size)


def test_torch_precision_setting_governs_tpu_tensors() -> None:
    chip.check_precision_governs("tpu")


def test_int64_labels_and_a_second_call_reuse_the_program() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 4).to("tpu").requires_grad_()
    x = torch.randn(48, 16).to("tpu")
    y = torch.randint(0, 4, (48,)).to("tpu")  # int64: checked and cast on the chip.

    @bridge_mr.torch_function
    def cross_entropy(w: Any, x: Any, y: Any) -> Any:
        logits = x @ w
        picked = jax.numpy.take_along_axis(logits, y[:, None], axis=1)
        return jax.numpy.mean(jax.nn.logsumexp(logits, axis=1) - picked[:, 0])

    for _ in range(2):
        loss = cross_entropy(w, x, y)
        (grad,) = torch.autograd.grad(loss, w)
    assert cross_entropy.trace_count == 1
    w_host = w.detach().cpu().requires_grad_()
    want = F.cross_entropy(x.cpu() @ w_host, y.cpu())
    (want_grad,) = torch.autograd.grad(want, w_host)
    assert abs(loss.detach().item() - want.item()) <= 1e-5 * abs(want.item())
    assert grad.device.type == "tpu"
    assert leaf_errors({"w": grad.cpu()}, {"w": want_grad})["w"] <= 1e-5
    with pytest.raises(ValueError, match=r"argument args\[2\]: a torch.int64 tensor crosses"):
        cross_entropy(w, x, y + 2**40)


def test_from_torch_cnn_with_batchnorm_on_tpu_tensors() -> None:
    case = chip.cnn_batchnorm_case()
    leaves = {k: v.to("tpu").requires_grad_() for k, v in case.params.items()}
    server = case.server(leaves, _tpu(case.buffers))
    loss, new_state = bridge_mr.map_reduce(case.client, server, _tpu(case.data))
    loss.backward()
    assert abs(loss.detach().item() - case.want_value) <= 1e-4 * abs(case.want_value)
    errors = leaf_errors(_host({k: v.grad for k, v in leaves.items()}), case.want)
    assert max(errors.values()) <= 1e-4, errors
    assert new_state["bn.running_mean"].device.type == "tpu"
    running_mean = new_state["bn.running_mean"].detach().cpu()
    assert not torch.equal(running_mean, case.buffers["bn.running_mean"])


def test_from_torch_gpt2_on_tpu_tensors() -> None:
    pytest.importorskip("transformers")
    case = chip.gpt2_case()
    leaves = {k: v.to("tpu").requires_grad_() for k, v in case.params.items()}
    server = case.server(leaves, _tpu(case.buffers))
    loss = bridge_mr.map_reduce(case.client, server, _tpu(case.data))
    loss.backward()
    assert abs(loss.detach().item() - case.want_value) <= 1e-4 * abs(case.want_value)
    errors = leaf_errors(_host({k: v.grad for k, v in leaves.items()}), case.want)
    assert max(errors.values()) <= 1e-3, errors


@pytest.mark.parametrize(("strategy", "chunk_size"), _STRATEGIES)
def test_a_fedavg_round_from_a_dataset_on_the_tpu(strategy: str, chunk_size: Any) -> None:
    """A dataset held on "tpu" (`FederatedDataset.to("tpu")`): its round gathers there and
    FedAvg's gradients on "tpu" equal those of the same round from host tensors."""
    optax = pytest.importorskip("optax")
    server, batch = chip.matmul_case()
    ids = torch.arange(12 * 32) % 12
    examples = {k: v.reshape(12 * 32, *v.shape[2:]) for k, v in batch.items()}
    train = bridge_mr.data.FederatedDataset.from_tensors(examples, ids)

    def local(params: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        h = b["x"] @ params["w1"]
        return F.mse_loss((h / (1 + h * h)) @ params["w2"], b["y"])

    steps = bridge_mr.algorithms.local_training(
        bridge_mr.from_torch(local), optax.sgd(0.1), steps=4
    )
    grads = []
    for dataset, device in ((train, "cpu"), (train.to("tpu"), "tpu")):
        rnd = dataset.round(batch_size=8, steps=4, generator=torch.Generator().manual_seed(0))
        assert all(v.device.type == device for v in rnd.batches.values())
        params = {k: v.to(device).requires_grad_() for k, v in server.items()}
        options = {"strategy": strategy, "chunk_size": chunk_size}
        bridge_mr.algorithms.outer_step(steps, params, rnd.batches, **options)
        grads.append(_host({k: v.grad for k, v in params.items()}))
    errors = leaf_errors(grads[1], grads[0])
    assert max(errors.values()) <= 1e-5, errors


def test_a_mesh_is_refused_with_tpu_tensors() -> None:
    server, batch = chip.matmul_case()
    mesh = jax.make_mesh((2,), ("clients",))
    with pytest.raises(NotImplementedError, match="TorchTPU tensors run a round on one chip"):
        bridge_mr.map_reduce(chip.matmul_client, _tpu(server), _tpu(batch), mesh=mesh)
