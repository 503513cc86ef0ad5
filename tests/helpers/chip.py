"""The TPU legs' shared cases: a two-layer client whose gradients show the products' precision,
and from_torch rounds (a CNN with BatchNorm, GPT-2) with their torch references."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

import bridge_mr

from . import zoo
from .precision import leaf_errors, torch_value_and_grads


def crossed_shapes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A list that collects the shape of every array `jax.device_put` is given from now on (for
    the rest of the test): what host tensors cross to a device as."""
    crossed: list[Any] = []
    device_put = jax.device_put

    def spy(x: Any, *args: Any, **kwargs: Any) -> Any:
        crossed.extend(getattr(a, "shape", None) for a in jax.tree.leaves(x))
        return device_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    return crossed


# The activation is rational, not tanh: the chip's transcendental functions are accurate to
# about 1e-5 relative (tanh moved these gradients by 2e-5 at "highest"), which would hide the
# products' precision that these tests check.
def matmul_client(server: dict[str, Any], batch: dict[str, Any]) -> Any:
    h = batch["x"] @ server["w1"]
    h = h / (1 + h * h)
    return jnp.mean((h @ server["w2"] - batch["y"]) ** 2)


def torch_matmul_loss(server: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
    losses = []
    for x, y in zip(batch["x"], batch["y"], strict=True):
        h = x @ server["w1"]
        h = h / (1 + h * h)
        losses.append(torch.mean((h @ server["w2"] - y) ** 2))
    return torch.stack(losses).mean()


def matmul_case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    server = {
        "w1": torch.randn(256, 256, generator=g) / 16,
        "w2": torch.randn(256, 8, generator=g) / 16,
    }
    batch = {"x": torch.randn(12, 32, 256, generator=g), "y": torch.randn(12, 32, 8, generator=g)}
    return server, batch


@dataclasses.dataclass
class Case:
    """A from_torch round and its torch reference.

    Attributes:
      params: the parameters (a gradient is wanted for each).
      buffers: what else the server sends (BatchNorm statistics, GPT-2's buffers).
      data: the clients' batches, the leading axis the clients.
      client: `(server, batch) -> loss[, state]`, server `{**params, **buffers}` (CNN) or
        `{"params", "buffers"}` (GPT-2), for `bridge_mr.map_reduce`.
      server: `(params, buffers) -> ` the server argument of `client`.
      want_value: the reference mean loss.
      want: the reference gradients of `params`.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    data: dict[str, torch.Tensor]
    client: Callable[..., Any]
    server: Callable[[dict[str, Any], dict[str, Any]], Any]
    want_value: float
    want: dict[str, torch.Tensor]


def cnn_batchnorm_case() -> Case:
    """A from_torch CNN with BatchNorm (its running statistics a mutable state), 6 clients of 8
    images; the reference a float64 torch loop."""
    model = zoo.tiny("cnn_batchnorm")
    data = zoo.tiny_data("cnn_batchnorm", 6, 8)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    torch_loss = zoo.tiny_loss(model)

    def client(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        return torch_loss(state, batch["x"], batch["y"])

    def loop(p: dict[str, torch.Tensor], d: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = [
            torch_loss({**p, **{k: v.double() for k, v in buffers.items()}}, x, y)
            for x, y in zip(d["x"], d["y"], strict=True)
        ]
        return torch.stack(losses).mean()

    want_value, want = torch_value_and_grads(loop, params, data)
    return Case(
        params,
        buffers,
        data,
        bridge_mr.from_torch(client, mutable=0),
        lambda p, b: {**p, **b},
        want_value,
        {k: want[k] for k in params},
    )


def gpt2_case() -> Case:
    """transformers' GPT-2 (the zoo's), FedSGD over 4 clients of 2 sequences; the reference a
    float32 torch loop on the host (GPT-2's float64 differs more from float32 than a TPU's
    float32 does)."""
    entry = zoo.ZOO["gpt2"]
    model = zoo.build("gpt2")
    params, buffers = zoo.split_state(model)
    g = torch.Generator().manual_seed(3)
    batches = [entry.batch(g, 2) for _ in range(4)]
    data = {k: torch.stack([b[k] for b in batches]) for k in batches[0]}
    loss_fn = zoo.client_loss(entry, model)
    converted = bridge_mr.from_torch(loss_fn)

    def fedsgd(server: dict[str, Any], batch: dict[str, Any]) -> Any:
        return converted(server["params"], server["buffers"], batch)

    torch_leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    per_client = [loss_fn(torch_leaves, buffers, {k: data[k][i] for k in data}) for i in range(4)]
    want_value = torch.stack(per_client).mean()
    want_value.backward()
    want = {k: v.grad for k, v in torch_leaves.items()}
    return Case(
        params,
        buffers,
        data,
        fedsgd,
        lambda p, b: {"params": p, "buffers": b},
        want_value.item(),
        want,  # type: ignore[arg-type]
    )


def bridge_value_and_grads(
    server: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], device: str, **options: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`matmul_client`'s mean loss over the clients by `bridge_mr.map_reduce` (`options`), from
    tensors on `device`, and its gradients (of `batch` too), which come back there."""
    # Fresh leaves on every call (`.to("cpu")` of a host tensor is that tensor: its .grad would
    # add up over calls).
    leaves = {
        k: v.detach().to(device, copy=True).requires_grad_() for k, v in {**server, **batch}.items()
    }
    loss = bridge_mr.map_reduce(
        matmul_client, {k: leaves[k] for k in server}, {k: leaves[k] for k in batch}, **options
    )
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items()}
    assert all(g is not None and g.device.type == device for g in grads.values())
    return loss, grads  # type: ignore[return-value]


def check_precision_governs(device: str) -> None:
    """Asserts that torch's float32 matmul precision, set between calls, governs the chip's
    products in `bridge_value_and_grads` from tensors on `device`: exact float32 at "highest"
    (also after the others), one bfloat16 pass at "medium" (an error a CPU never shows, so the
    chip ran the program), three passes at "high"."""
    server, batch = matmul_case()
    _, want = torch_value_and_grads(torch_matmul_loss, server, batch)
    worst = {}
    for precision in ("highest", "medium", "high", "highest"):
        torch.set_float32_matmul_precision(precision)
        _, grads = bridge_value_and_grads(server, batch, device, strategy="vmap")
        worst[precision] = max(leaf_errors({k: g.cpu() for k, g in grads.items()}, want).values())
        if precision == "highest":
            assert worst[precision] <= 1e-5, worst
    assert 1e-4 < worst["medium"] < 3e-2, worst
    assert worst["high"] < worst["medium"] / 10, worst


def check_equal_torch_at_highest(device: str, **options: Any) -> None:
    """Asserts that `bridge_value_and_grads` from tensors on `device` (`options`: map_reduce's)
    gives a float32 loss there, and the loss and gradients of a float64 torch loop within 1e-5
    (torch's precision must be "highest")."""
    server, batch = matmul_case()
    want_value, want = torch_value_and_grads(torch_matmul_loss, server, batch)
    loss, grads = bridge_value_and_grads(server, batch, device, **options)
    assert loss.device.type == device
    assert loss.dtype == torch.float32
    assert abs(loss.detach().item() - want_value) <= 1e-5 * abs(want_value)
    errors = leaf_errors({k: g.cpu() for k, g in grads.items()}, want)
    assert max(errors.values()) <= 1e-5, errors
