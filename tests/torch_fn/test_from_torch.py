"""`bridge_mr.from_torch`: torch-written client code, differential against pure torch.

Every tiny net of the zoo (`TINY` of tests/helpers/zoo.py: one per layer family) runs through
`map_reduce` as FedSGD (the mean loss, and gradients in `.grad`) and as a FedAvg round with
local steps (a `lax.scan` of `jax.grad` over the converted loss), for several client counts,
against a pure-torch loop over per-client copies. x64 is off, labels are torch's default int64.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import zoo
from jax.sharding import AxisType
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

# Each test builds its own model and client functions, so map_reduce sees new function objects of
# the same code from test to test; the training-loop tests assert the trace counts themselves.
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")

RTOL, ATOL = 2e-4, 2e-5
LR = 0.1


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _close(actual: Any, expected: Any, what: str) -> None:
    if not isinstance(actual, torch.Tensor):
        actual = torch.from_numpy(np.array(actual))
    torch.testing.assert_close(
        actual.detach().to(torch.float32),
        torch.as_tensor(expected, dtype=torch.float32).detach(),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )


# ---------------------------------------------------------------------------------------------
# FedSGD: map_reduce of the converted loss; values, .grad and the averaged buffers.


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
    out = bridge_mr.map_reduce(converted, _state(model), data)
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
    _close(loss.detach(), torch.stack(losses).mean(), f"{name} loss")
    for (k, p), g in zip(reference.named_parameters(), got_grads.values(), strict=True):
        _close(g, p.grad, f"{name} grad {k}")
    if new_state is not None:
        for k in dict(model.named_buffers()):
            expected = torch.stack([b[k].to(torch.float32) for b in buffers]).mean(0)
            _close(new_state[k].detach(), expected, f"{name} buffer {k}")


# ---------------------------------------------------------------------------------------------
# FedAvg: local SGD steps inside each client (lax.scan over jax.grad of the converted loss).


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
    state = {k: v.detach() for k, v in _state(model).items()}
    got = bridge_mr.map_reduce(_fedavg_update(model), state, data)
    expected = _torch_fedavg(model, data)
    assert set(got) == set(expected)
    for k in expected:
        _close(got[k], expected[k], f"{name} {k}")


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
        state = {k: v.detach() for k, v in _state(model).items()}
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


def test_a_conversion_reuses_its_trace_and_a_new_one_sees_eval_mode() -> None:
    model = zoo.tiny("cnn_batchnorm")
    data = zoo.tiny_data("cnn_batchnorm", 2, 4)
    loss = zoo.tiny_loss(model)

    def fn(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss(state, batch["x"], batch["y"])

    converted = bridge_mr.from_torch(fn, mutable=0)
    counts = []
    for _ in range(3):
        out, _ = bridge_mr.map_reduce(converted, _state(model), data)
        out.backward()
        counts.append(bridge_mr.trace_counts()["map_reduce"])
    assert counts[0] == counts[-1]
    model.eval()  # read when traced, as jax.jit reads a function's state: convert again
    eval_loss, _ = bridge_mr.map_reduce(bridge_mr.from_torch(fn, mutable=0), _state(model), data)
    with torch.no_grad():
        expected = torch.stack([loss(_state(model), data["x"][c], data["y"][c]) for c in range(2)])
    _close(eval_loss.detach(), expected.mean(), "eval-mode loss")


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


# ---------------------------------------------------------------------------------------------
# As a JAX function: jit, grad, vmap, eval-mode buffers.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["cnn_groupnorm", "gru", "transformer"])
def test_value_and_grad_match_torch_autograd(name: str, jit: bool) -> None:
    model = zoo.tiny(name)
    data = zoo.tiny_data(name, 6)
    converted = bridge_mr.from_torch(zoo.tiny_loss(model))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    x, y = jnp.asarray(data["x"].numpy()), jnp.asarray(data["y"].numpy().astype(np.int32))
    value_and_grad = jax.value_and_grad(converted)
    loss, grads = (jax.jit(value_and_grad) if jit else value_and_grad)(params, x, y)
    expected = F.cross_entropy(model(data["x"]), data["y"])
    expected.backward()
    _close(loss, expected, "loss")
    for k, p in model.named_parameters():
        _close(grads[k], p.grad, k)


def test_vmap_over_clients_matches_per_client_calls() -> None:
    model = zoo.tiny("lstm")
    data = zoo.tiny_data("lstm", 3, 4)
    converted = bridge_mr.from_torch(zoo.tiny_loss(model))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    x, y = jnp.asarray(data["x"].numpy()), jnp.asarray(data["y"].numpy().astype(np.int32))
    batched = jax.vmap(converted, in_axes=(None, 0, 0))(params, x, y)
    for c in range(3):
        _close(batched[c], F.cross_entropy(model(data["x"][c]), data["y"][c]), f"client {c}")


def test_batchnorm_eval_mode_uses_the_running_statistics_unchanged() -> None:
    model = zoo.tiny("cnn_batchnorm")
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    x = zoo.tiny_data("cnn_batchnorm", 4)["x"]
    converted = bridge_mr.from_torch(
        lambda s, x: torch.func.functional_call(model, s, (x,)), mutable=0
    )
    state = {k: jnp.asarray(v.detach().numpy()) for k, v in _state(model).items()}
    out, after = converted(state, jnp.asarray(x.numpy()))
    _close(out, model(x), "eval output")
    for k in state:
        assert after[k] is state[k], f"{k} changed in eval mode"


# ---------------------------------------------------------------------------------------------
# Randomness: keys, not torch's generator.


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 64), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


def test_dropout_draws_from_the_key_per_client_and_per_step() -> None:
    torch.manual_seed(0)
    model = Dropout()
    x = torch.randn(3, 5, 12)
    fn = bridge_mr.from_torch(
        lambda s, b: torch.func.functional_call(model, s, (b["x"],)), rng=True
    )

    def client(state: Any, batch: Any) -> Any:
        return fn(batch["key"], state, batch)

    params = dict(model.named_parameters())

    def outputs(step: int, seed: int = 0) -> torch.Tensor:
        with bridge_mr.program(placements={"clients": 3}):
            placed = bridge_mr.broadcast(params)
            keys = bridge_mr.client_keys(seed, step, 3)
            return bridge_mr.map_fn(client, (placed, {"x": x, "key": keys})).detach()

    first, again, next_step, other_seed = outputs(0), outputs(0), outputs(1), outputs(0, seed=1)
    torch.testing.assert_close(first, again)  # reproducible from the seed
    dropped = first == 0
    assert not torch.equal(dropped[0], dropped[1]), "clients 0 and 1 drew the same mask"
    assert not torch.equal(dropped, next_step == 0), "the mask did not change with the step"
    assert not torch.equal(dropped, other_seed == 0), "the mask did not change with the seed"
    assert 0.3 < float(dropped.float().mean()) < 0.7
    kept = model.fc(x).detach() * 2  # inverted dropout scales what it keeps by 1 / (1 - p)
    torch.testing.assert_close(first[~dropped], kept[~dropped], rtol=RTOL, atol=ATOL)


def test_dropout_in_eval_mode_needs_no_key_and_matches_torch() -> None:
    torch.manual_seed(0)
    model = Dropout().eval()
    x = torch.randn(5, 12)
    converted = bridge_mr.from_torch(lambda s, x: torch.func.functional_call(model, s, (x,)))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    _close(converted(params, jnp.asarray(x.numpy())), model(x), "eval dropout")


def test_random_ops_without_a_key_are_a_clear_error() -> None:
    torch.manual_seed(0)
    model = Dropout()
    converted = bridge_mr.from_torch(lambda s, x: torch.func.functional_call(model, s, (x,)))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    with pytest.raises(UnsupportedTorchOperation, match=r"rng=True.*torch.manual_seed|manual_seed"):
        converted(params, jnp.ones((2, 12)))
    noisy = bridge_mr.from_torch(lambda x: x + torch.randn(x.shape))
    with pytest.raises(UnsupportedTorchOperation, match=r"test_from_torch.py:\d+"):
        noisy(jnp.ones(3))


def test_keys_may_be_typed_raw_or_an_integer_seed() -> None:
    noisy = bridge_mr.from_torch(lambda x: x + torch.randn(x.shape), rng=True)
    x = jnp.zeros(4)
    typed = noisy(jax.random.key(7), x)
    raw = noisy(jax.random.key_data(jax.random.key(7)), x)
    seed = noisy(7, x)
    np.testing.assert_array_equal(typed, raw)
    np.testing.assert_array_equal(typed, seed)
    assert not np.array_equal(typed, noisy(8, x))
    with pytest.raises(TypeError, match="expected a JAX key"):
        noisy(jnp.zeros(3), x)
    with pytest.raises(TypeError, match="first argument"):
        noisy()


# ---------------------------------------------------------------------------------------------
# No graph breaks: in-place ops, views, no_grad and detach, hooks.


def test_in_place_ops_and_views_on_intermediates_work() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h[0] += 1.0  # in place through a view
        h.relu_()
        h.view(-1)[1:3].mul_(3.0)
        return h.t().contiguous().sum(0)

    x = torch.randn(3, 4)
    _close(bridge_mr.from_torch(fn)(jnp.asarray(x.numpy())), fn(x.clone()), "in-place")


def test_no_grad_blocks_and_detach_stop_gradients_as_in_torch() -> None:
    def fn(w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = (w * 3).sum()
        return (w * target).sum() + (w * w.detach()).sum()

    w = torch.tensor([1.0, 2.0, -1.0], requires_grad=True)
    fn(w).backward()
    grad = jax.grad(bridge_mr.from_torch(fn))(jnp.asarray(w.detach().numpy()))
    _close(grad, w.grad, "grad")


def test_the_callers_no_grad_does_not_reach_inside() -> None:
    fn = bridge_mr.from_torch(lambda w: (w * w).sum())
    with torch.no_grad():  # as FedAvg calls map_reduce: JAX's own gradients inside must flow
        grad = jax.grad(fn)(jnp.asarray([1.0, 2.0]))
    np.testing.assert_allclose(np.asarray(grad), [2.0, 4.0])


def test_forward_hooks_run() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.register_forward_hook(lambda m, args, out: out * 2)
    x = torch.randn(2, 4)
    converted = bridge_mr.from_torch(lambda s, x: torch.func.functional_call(model, s, (x,)))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    _close(converted(params, jnp.asarray(x.numpy())), model(x), "hooked output")


# ---------------------------------------------------------------------------------------------
# Errors: what cannot be lowered is refused at trace time, naming the op and the line.


def test_an_op_without_a_lowering_names_the_op_and_the_source_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._cdist_backward(x, x, x, 2.0, x)  # no JAX lowering

    with pytest.raises(UnsupportedTorchOperation) as info:
        bridge_mr.from_torch(fn)(jnp.ones((2, 2)))
    message = str(info.value)
    assert "_cdist_backward" in message
    assert "unsupported in the JAX lowering" in message
    assert "test_from_torch.py:" in message
    assert "never falls back to eager torch" in message


def test_a_captured_tensor_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    converted = bridge_mr.from_torch(lambda x: model(x))  # parameters not passed in
    with pytest.raises(UnsupportedTorchOperation, match="functional_call"):
        converted(jnp.ones((2, 4)))
    scale = torch.tensor(2.0)
    with pytest.raises(UnsupportedTorchOperation, match="did not receive"):
        bridge_mr.from_torch(lambda x: x * scale)(jnp.ones(3))


def test_writing_to_an_argument_that_is_not_mutable_is_an_error() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.add_(1.0)
        return x + y

    with pytest.raises(UnsupportedTorchOperation, match=r"argument \[1\].*mutable=1"):
        bridge_mr.from_torch(fn)(jnp.ones(2), jnp.ones(2))
    out, y_after = bridge_mr.from_torch(fn, mutable=1)(jnp.ones(2), jnp.ones(2))
    np.testing.assert_array_equal(out, [3.0, 3.0])
    np.testing.assert_array_equal(y_after, [2.0, 2.0])
    out, (x_after, y_after) = bridge_mr.from_torch(fn, mutable=(0, 1))(jnp.ones(2), jnp.ones(2))
    np.testing.assert_array_equal(x_after, [1.0, 1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mutable": -1}, "mutable"),
        ({"mutable": (0, 0)}, "mutable"),
        ({"mutable": "0"}, "mutable"),
        ({"rng": 1}, "rng"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        bridge_mr.from_torch(lambda x: x, **kwargs)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(TypeError, match="callable"):
        bridge_mr.from_torch(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch tensor"):
        bridge_mr.from_torch(lambda x: x)(torch.ones(2))
    with pytest.raises(TypeError, match="PRNG key"):
        bridge_mr.from_torch(lambda k: k)(jax.random.key(0))
    with pytest.raises(TypeError, match="positional argument 1"):
        bridge_mr.from_torch(lambda x, y=None: x, mutable=1)(jnp.ones(2))


@pytest.mark.parametrize(
    ("args", "error"),
    [((-1, 0, 2), ValueError), ((0, 0, 0), ValueError), ((0.5, 0, 2), TypeError)],
)
def test_client_keys_checks_its_arguments(args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error, match="client_keys"):
        bridge_mr.client_keys(*args)


def test_client_keys_are_the_folded_keys() -> None:
    keys = bridge_mr.client_keys(5, 2, 3)
    assert keys.dtype == torch.uint32
    assert keys.shape == (3, 2)
    base = jax.random.fold_in(jax.random.key(5), 2)
    for c in range(3):
        expected = jax.random.key_data(jax.random.fold_in(base, c))
        np.testing.assert_array_equal(keys[c].numpy(), np.asarray(expected))


def test_coverage_table_is_the_zoo() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "from_torch.md"
    layers = doc.read_text().split("\n## Models users train", 1)[0]  # (test_model_zoo: the rest)
    rows = re.findall(r"^\| `(\w+)` \|", layers, re.M)
    assert sorted(rows) == sorted(zoo.TINY), "docs/from_torch.md's table and the zoo differ"


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_over_clients_equals_unsharded(axis_type: str) -> None:
    model = zoo.tiny("cnn_batchnorm")
    data = zoo.tiny_data("cnn_batchnorm", 8, 4)
    loss = zoo.tiny_loss(model)
    fn = bridge_mr.from_torch(lambda s, b: loss(s, b["x"], b["y"]), mutable=0)
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(getattr(AxisType, axis_type),))

    def run(**kwargs: Any) -> Any:
        state = {
            k: v.detach().requires_grad_(v.is_floating_point()) for k, v in _state(model).items()
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


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_reads_like_torch_with_a_smaller_index(dim: int) -> None:
    x = torch.randn(3, 5)
    index = torch.tensor([[0, 2], [1, 1]]) % x.shape[dim]
    got = bridge_mr.from_torch(lambda x, i: torch.gather(x, dim, i))(
        jnp.asarray(x.numpy()), jnp.asarray(index.numpy().astype(np.int32))
    )
    _close(got, torch.gather(x, dim, index), "gather")


def test_long_inside_computes_in_int32_with_jax_s_warning() -> None:
    fn = bridge_mr.from_torch(lambda logits, y: F.cross_entropy(logits, y.long()))
    logits = torch.randn(4, 3)
    y = torch.tensor([0, 2, 1, 2])
    with pytest.warns(UserWarning, match=r"int64 .* truncated to dtype int32"):
        got = fn(jnp.asarray(logits.numpy()), jnp.asarray(y.numpy().astype(np.int32)))
    _close(got, F.cross_entropy(logits, y), "cross_entropy of .long() labels")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_to_a_dtype_a_device_or_a_tensor_converts_like_torch(jit: bool) -> None:
    def fn(x: torch.Tensor) -> Any:
        return (
            x.to(torch.float16).to(torch.float32) * 3,
            x.to("jax") * 3,
            x.to(dtype=torch.int32),
            x.to(x) + 1,
            x.cpu() * 2,
        )

    x = torch.tensor([1.0, 2.5, -3.0])
    converted = bridge_mr.from_torch(fn)
    got = (jax.jit(converted) if jit else converted)(jnp.asarray(x.numpy()))
    expected = (x.half().float() * 3, x * 3, x.int(), x + 1, x * 2)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b.numpy())


def test_numpy_arguments_are_not_taken_for_writes_and_64_bit_ones_are_refused() -> None:
    out = bridge_mr.from_torch(lambda x: x * 2)(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])
    with pytest.raises(TypeError, match=r"float64.*narrow"):
        bridge_mr.from_torch(lambda x: x * 2)(np.arange(3.0))


def test_gather_with_a_bad_dim_or_index_shape_is_an_error() -> None:
    x = jnp.ones((2, 3))
    with pytest.raises(UnsupportedTorchOperation, match="dim=3"):
        bridge_mr.from_torch(lambda x, i: torch.gather(x, 3, i))(x, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(UnsupportedTorchOperation, match="index shape"):
        bridge_mr.from_torch(lambda x, i: torch.gather(x, 1, i))(x, jnp.zeros((4, 1), jnp.int32))


def _models_loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(_MODELS[0], params, (x,)).square().mean()


_MODELS = [nn.Linear(3, 2)]


def test_conversions_of_different_functions_are_not_counted_as_retraces() -> None:
    bridge_mr.clear_caches()
    # Every from_torch conversion shares one closure's code: the count follows the torch
    # function that could not be keyed by value (each reads a module), not that closure.
    x = torch.randn(4, 5, 3)
    params = dict(_MODELS[0].named_parameters())

    def first(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).mean()

    def second(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).square().mean()

    def third(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).abs().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error", bridge_mr.RetraceWarning)
        for fn in (first, second, third, _models_loss):
            bridge_mr.map_reduce(bridge_mr.from_torch(fn), params, x, strategy="vmap")


def test_converting_the_same_function_again_on_every_call_warns() -> None:
    bridge_mr.clear_caches()  # The count is per process: start from none.
    x = torch.randn(4, 5, 3)
    params = dict(_MODELS[0].named_parameters())

    def convert_and_call() -> None:
        loss = bridge_mr.from_torch(_models_loss)
        bridge_mr.map_reduce(loss, params, x, strategy="vmap")

    convert_and_call()
    convert_and_call()
    with pytest.warns(bridge_mr.RetraceWarning, match=r"traced _models_loss at .* 3 times"):
        convert_and_call()


# ---------------------------------------------------------------------------------------------
# Tensors the torch code creates are JAX values, whatever device it names.


def _factories(x: torch.Tensor, accelerator: str = "cuda") -> torch.Tensor:
    """Factories as library code writes them: devices of traced tensors, "cpu", "cuda"."""
    h = x * 2  # an intermediate: functionalization's wrapper of it reports the meta device
    out = h + torch.arange(4, device=h.device) + torch.zeros(3, 4, device="cpu")
    out = (
        out + torch.ones(4, device=torch.device("cpu")) + torch.full((4,), 0.5, device=accelerator)
    )
    out = out + h.new_zeros(3, 4) + h.new_full((4,), 1.0) + h.new_ones(4) + h.new_empty(4).fill_(2)
    out = out + h.new_tensor([1.0, 2.0, 3.0, 4.0]) + x.new_tensor(3.0)
    out = out + torch.zeros_like(h, device="cpu") + torch.full_like(h, 2.0) + torch.ones_like(h)
    out = out + torch.tensor(3.0, device=h.device) * torch.eye(4, device=h.device)[0]
    out = out * torch.tensor(2, device=h.device) + torch.linspace(0, 1, 4, device=h.device)
    keep = torch.triu(torch.ones(4, 4, dtype=torch.bool, device=h.device))[1]
    out = torch.where(keep, out, torch.zeros((), device=h.device, dtype=h.dtype))
    scale = torch.arange(4).to(h.device).to(device=h.device, dtype=h.dtype)
    written = torch.zeros(3, 4)  # made inside, then written into (as pad_sequence writes)
    written[1] = h[0]
    written[:, 2:] += h[:, 2:] * 3
    written[2].copy_(h[1]).mul_(2)
    return (out * scale + written).sum(-1)


def _in_torch(x: torch.Tensor) -> torch.Tensor:
    return _factories(x, accelerator="cpu")  # torch itself has no CUDA here


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "scan"])
def test_factories_with_any_device_are_jax_values(transform: str) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    fn = bridge_mr.from_torch(_factories)
    jx = jnp.asarray(x.numpy())
    if transform in ("eager", "jit"):
        got = (jax.jit(fn) if transform == "jit" else fn)(jx)
        _close(got, _in_torch(x), "factories")
    elif transform == "grad":
        got = jax.jit(jax.grad(lambda v: fn(v).sum()))(jx)
        _close(got, torch.func.grad(lambda v: _in_torch(v).sum())(x), "factories' gradient")
    elif transform == "vmap":
        xs = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
        got = jax.vmap(fn)(jnp.asarray(xs.numpy()))
        _close(got, torch.stack([_in_torch(v) for v in xs]), "vmap of factories")
    else:
        xs = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
        _, got = jax.lax.scan(lambda c, v: (c, fn(v)), 0, jnp.asarray(xs.numpy()))
        _close(got, torch.stack([_in_torch(v) for v in xs]), "scan of factories")


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "chunks", "auto"])
def test_factories_with_any_device_work_under_every_map_reduce_strategy(strategy: str) -> None:
    w = torch.randn(4, requires_grad=True, generator=torch.Generator().manual_seed(2))
    xs = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(3))
    fn = bridge_mr.from_torch(lambda w, x: (_factories(x * w) ** 2).mean())
    chunks = {"chunk_size": 4} if strategy == "chunks" else {}
    loss = bridge_mr.map_reduce(fn, w, xs, strategy=strategy, **chunks)
    loss.backward()
    reference = w.detach().clone().requires_grad_()
    expected = torch.stack([(_in_torch(x * reference) ** 2).mean() for x in xs]).mean()
    expected.backward()
    _close(loss, expected, f"{strategy} loss")
    _close(w.grad, reference.grad, f"{strategy} gradient")


def test_a_python_bool_of_a_traced_value_names_the_line_and_the_way_out() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():  # a data-dependent Python branch
            return x
        return -x

    x = jnp.ones(3)
    np.testing.assert_array_equal(np.asarray(bridge_mr.from_torch(fn)(x)), np.ones(3))  # eager
    with pytest.raises(
        UnsupportedTorchOperation,
        match=r"test_from_torch\.py:\d+ \(fn: if \(x > 0\)\.all\(\):.*reads a traced value as a "
        r"Python number or bool.*torch\.where",
    ):
        jax.jit(bridge_mr.from_torch(fn))(x)


def test_libraries_see_that_they_are_traced_under_jit_and_not_when_eager() -> None:
    # transformers is in the main environment's dev extra (the model zoo), not in .venv-xla.
    is_tracing = pytest.importorskip("transformers.utils.import_utils").is_tracing

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([
            torch.tensor(float(is_tracing(x))),  # an argument
            torch.tensor(float(is_tracing(x.bool()))),  # a result of a function-level op
            torch.tensor(float(is_tracing(x.to(torch.int32)))),  # of a device move
        ])  # fmt: skip

    converted = bridge_mr.from_torch(fn)
    np.testing.assert_array_equal(np.asarray(converted(jnp.ones(3))), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(jax.jit(converted)(jnp.ones(3))), [1.0, 1.0, 1.0])
