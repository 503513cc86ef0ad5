"""`bridge_mr.from_torch`: the tiny nets of the zoo through `map_reduce`, against pure torch.

Every tiny net of the zoo (`TINY` of tests/helpers/zoo.py: one per layer family) runs through
`map_reduce` as FedSGD (the mean loss, and gradients in `.grad`) and as a FedAvg round with
local steps (a `lax.scan` of `jax.grad` over the converted loss), for several client counts,
against a pure-torch loop over per-client copies; x64 is off, labels are torch's default int64.
Then training loops that converge, the clients sharded over a mesh, `torch_function` of a
converted function, and the docs' coverage table.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import pytest
import torch
import torch.nn.functional as F
from helpers import zoo
from helpers.from_torch import ATOL, RTOL, close, state_of
from jax.sharding import AxisType
from torch import nn

import bridge_mr

# Each test builds its own model and client functions, so map_reduce sees new function objects of
# the same code from test to test; the training-loop tests assert the trace counts themselves.
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


LR = 0.1


@pytest.mark.parametrize("clients", [1, 3])
@pytest.mark.parametrize("name", list(zoo.TINY))
def test_fedsgd_through_map_reduce_matches_a_torch_loop(name: str, clients: int) -> None:
    model = zoo.tiny(name)
    data = zoo.tiny_data(name, clients, 4)
    torch_loss = zoo.tiny_loss(model)
    has_buffers = bool(dict(model.named_buffers()))

    def fn(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        return torch_loss(state, batch["x"], batch["y"])

    converted = bridge_mr.from_torch(fn, mutable=0) if has_buffers else bridge_mr.from_torch(fn)
    out = bridge_mr.map_reduce(converted, state_of(model), data)
    loss, new_state = out if has_buffers else (out, None)
    loss.backward()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}  # type: ignore[union-attr]

    reference = copy.deepcopy(model)
    losses, buffers = [], []
    for c in range(clients):
        client = copy.deepcopy(reference)
        for p in client.parameters():
            p.grad = None
        client_loss = F.cross_entropy(client(data["x"][c]), data["y"][c])
        (client_loss / clients).backward()
        losses.append(client_loss.detach())
        buffers.append(dict(client.named_buffers()))
        for p, q in zip(reference.parameters(), client.parameters(), strict=True):
            p.grad = q.grad if p.grad is None else p.grad + q.grad  # type: ignore[operator]
    close(loss.detach(), torch.stack(losses).mean(), f"{name} loss")
    for (k, p), g in zip(reference.named_parameters(), got_grads.values(), strict=True):
        close(g, p.grad, f"{name} grad {k}")
    if new_state is not None:
        for k in dict(model.named_buffers()):
            expected = torch.stack([b[k].to(torch.float32) for b in buffers]).mean(0)
            close(new_state[k].detach(), expected, f"{name} buffer {k}")


def _fedavg_update(model: nn.Module) -> Callable[..., Any]:
    names = tuple(k for k, _ in model.named_parameters())
    step_loss = bridge_mr.from_torch(zoo.tiny_loss(model), mutable=0)

    def client_update(server: dict[str, jax.Array], data: dict[str, jax.Array]) -> Any:
        def one(state: dict[str, jax.Array], xy: tuple[jax.Array, jax.Array]) -> Any:
            x, y = xy
            params = {k: state[k] for k in names}

            def f(p: dict[str, jax.Array]) -> Any:
                return step_loss({**state, **p}, x, y)

            (loss, new), grads = jax.value_and_grad(f, has_aux=True)(params)
            return {**new, **{k: params[k] - LR * grads[k] for k in names}}, loss

        final, _ = jax.lax.scan(one, server, (data["x"], data["y"]))
        return {k: final[k] - server[k] for k in names} | {
            k: final[k] for k in server if k not in names
        }

    return client_update


def _torch_fedavg(model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each client: a copy of the model, local SGD; the mean parameter delta and buffers."""
    clients, steps = data["y"].shape[:2]
    deltas: list[dict[str, torch.Tensor]] = []
    for c in range(clients):
        client = copy.deepcopy(model)
        optimizer = torch.optim.SGD(client.parameters(), lr=LR)
        for s in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(client(data["x"][c, s]), data["y"][c, s]).backward()
            optimizer.step()
        start = dict(model.named_parameters())
        deltas.append(
            {k: (p - start[k]).detach() for k, p in client.named_parameters()}
            | {k: b.detach().to(torch.float32) for k, b in client.named_buffers()}
        )
    return {k: torch.stack([d[k] for d in deltas]).mean(0) for k in deltas[0]}


@pytest.mark.parametrize("clients", [1, 4])
@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "lstm", "transformer"])
def test_fedavg_round_with_local_steps_matches_a_torch_loop(name: str, clients: int) -> None:
    model = zoo.tiny(name)
    data = zoo.tiny_data(name, clients, 3, 4)  # [clients, local steps, batch, ...]
    state = {k: v.detach() for k, v in state_of(model).items()}
    got = bridge_mr.map_reduce(_fedavg_update(model), state, data)
    expected = _torch_fedavg(model, data)
    assert set(got) == set(expected)
    for k in expected:
        close(got[k], expected[k], f"{name} {k}")


def test_fedavg_training_loop_converges_and_traces_once() -> None:
    model = zoo.tiny("cnn_batchnorm")
    g = torch.Generator().manual_seed(2)
    # A learnable task: the label is the quadrant of the brightest pixel.
    x = torch.randn(4, 2, 16, 1, 8, 8, generator=g)
    flat = x.flatten(-2).argmax(-1).squeeze(-1)
    y = (flat // 8 >= 4).long() * 2 + (flat % 8 >= 4).long()
    update = _fedavg_update(model)
    server_opt = torch.optim.SGD(model.parameters(), lr=1.0)
    names = {k for k, _ in model.named_parameters()}

    def mean_loss() -> float:
        with torch.no_grad():
            model.eval()
            loss = F.cross_entropy(model(x.flatten(0, 2)), y.flatten())
            model.train()
            return float(loss)

    before = mean_loss()
    counts = []
    for _ in range(8):
        state = {k: v.detach() for k, v in state_of(model).items()}
        result = bridge_mr.map_reduce(update, state, {"x": x, "y": y})
        server_opt.zero_grad()
        for k, p in model.named_parameters():
            p.grad = -result[k]
        server_opt.step()
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k not in names:
                    b.copy_(result[k])
        counts.append(bridge_mr.trace_counts()["map_reduce"])
    assert mean_loss() < 0.8 * before
    assert counts[-1] == counts[0], f"map_reduce traced again during training: {counts}"


def test_a_torch_optimizer_loop_through_fedsgd_converges() -> None:
    model = zoo.tiny("mlp")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, 12, generator=g)
    y = (x[..., :5]).argmax(-1)
    fn = bridge_mr.from_torch(lambda s, b: zoo.tiny_loss(model)(s, b["x"], b["y"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = bridge_mr.map_reduce(fn, dict(model.named_parameters()), {"x": x, "y": y})
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_over_clients_equals_unsharded(axis_type: str) -> None:
    model = zoo.tiny("cnn_batchnorm")
    data = zoo.tiny_data("cnn_batchnorm", 8, 4)
    loss = zoo.tiny_loss(model)
    fn = bridge_mr.from_torch(lambda s, b: loss(s, b["x"], b["y"]), mutable=0)
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(getattr(AxisType, axis_type),))

    def run(**kwargs: Any) -> Any:
        state = {
            k: v.detach().requires_grad_(v.is_floating_point()) for k, v in state_of(model).items()
        }
        value, new = bridge_mr.map_reduce(fn, state, data, **kwargs)
        grads = torch.autograd.grad(value, [state[k] for k, _ in model.named_parameters()])
        return value.detach(), grads, {k: v.detach() for k, v in new.items()}

    sharded, plain = run(mesh=mesh), run()
    torch.testing.assert_close(sharded, plain, rtol=1e-5, atol=1e-6)


def test_torch_function_of_a_converted_function_is_differentiable_in_torch() -> None:
    def fn(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum()

    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    f = bridge_mr.torch_function(bridge_mr.from_torch(fn))
    f(w, x).backward()
    expected = w.detach().clone().requires_grad_()
    fn(expected, x).backward()
    torch.testing.assert_close(w.grad, expected.grad, rtol=RTOL, atol=ATOL)


def test_coverage_table_is_the_zoo() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "from_torch.md"
    layers = doc.read_text().split("\n## Models users train", 1)[0]  # (test_model_zoo: the rest)
    rows = re.findall(r"^\| `(\w+)` \|", layers, re.M)
    assert sorted(rows) == sorted(zoo.TINY), "docs/from_torch.md's table and the zoo differ"
