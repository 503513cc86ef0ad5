"""`from_torch` on the XLA device: a FedSGD and a FedAvg round of a torch-written BatchNorm CNN.

The same rounds on CPU tensors are the reference (tests/torch_fn covers them against pure
torch); on XLA the converted JAX program is embedded in torch-xla's lazy graph.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bridge_mr

pytestmark = pytest.mark.xla

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


MODEL = _model()
NAMES = tuple(k for k, _ in MODEL.named_parameters())


def _loss(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(torch.func.functional_call(MODEL, state, (x,)), y)


STEP_LOSS = bridge_mr.from_torch(_loss, mutable=0)


def _fedsgd(state: Any, batch: Any) -> Any:
    return STEP_LOSS(state, batch["x"], batch["y"])


def _fedavg(server: dict[str, jax.Array], data: dict[str, jax.Array]) -> Any:
    def one(state: dict[str, jax.Array], xy: tuple[jax.Array, jax.Array]) -> Any:
        params = {k: state[k] for k in NAMES}
        (loss, new), grads = jax.value_and_grad(
            lambda p: STEP_LOSS({**state, **p}, *xy), has_aux=True
        )(params)
        return {**new, **{k: params[k] - LR * grads[k] for k in NAMES}}, loss

    final, _ = jax.lax.scan(one, server, (data["x"], data["y"]))
    return {k: final[k] - server[k] if k in NAMES else final[k] for k in server}


def _data(*lead: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(*lead, 1, 8, 8, generator=g),
        "y": torch.randint(5, tuple(lead), generator=g),  # int64 labels
    }


def _state(model: nn.Module, device: Any) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().to(device)
        for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()
    }


def test_fedsgd_round_through_from_torch_on_xla_matches_cpu(xla: Any) -> None:
    device = xla.device()
    data = _data(4, 6)
    results = {}
    for where in ("cpu", device):
        model = copy.deepcopy(MODEL).to(where)
        params = dict(model.named_parameters())
        state = {**params, **{k: v for k, v in model.named_buffers()}}
        loss, new_state = bridge_mr.map_reduce(
            _fedsgd, state, {k: v.to(where) for k, v in data.items()}
        )
        loss.backward()
        results[str(where)] = (
            loss.detach().cpu(),
            {k: p.grad.cpu() for k, p in params.items()},  # type: ignore[union-attr]
            {k: new_state[k].detach().cpu() for k in dict(model.named_buffers())},
        )
    cpu, on_xla = results["cpu"], results[str(device)]
    torch.testing.assert_close(on_xla[0], cpu[0], **TOLERANCE)
    for a, b in zip(on_xla[1:], cpu[1:], strict=True):
        for k in b:
            torch.testing.assert_close(a[k], b[k], **TOLERANCE, msg=lambda m, k=k: f"{k}: {m}")


def test_fedavg_round_through_from_torch_on_xla_matches_cpu(xla: Any) -> None:
    device = xla.device()
    data = _data(4, 3, 6)
    results = {}
    for where in ("cpu", device):
        state = _state(MODEL, where)
        with torch.no_grad():
            out = bridge_mr.map_reduce(_fedavg, state, {k: v.to(where) for k, v in data.items()})
        results[str(where)] = {k: v.cpu() for k, v in out.items()}
    for k, expected in results["cpu"].items():
        torch.testing.assert_close(
            results[str(device)][k], expected, **TOLERANCE, msg=lambda m, k=k: f"{k}: {m}"
        )
    assert float(results["cpu"]["0.weight"].abs().sum()) > 0
