"""`from_torch` of torch's recurrent layers: one `lax.scan` over time, values and gradients
equal to torch's.

`nn.LSTM`, `nn.GRU` and `nn.RNN` reach torchax as `aten._cudnn_rnn` (bridge_mr's lowering:
a scan per layer and direction). Each option is compared with torch autograd in float64 (where
both sides compute the same, 1e-10) and in float32 against float64 torch, leaf by leaf as
||got - torch|| / ||torch||: float32's own rounding through a few steps of recurrence (at most
5.3e-7 measured, 5e-6 allowed). Then: `vmap`, an eager call, every `map_reduce` strategy, dropout
between layers under `rng=True`, the traced program's size over sequence lengths, and the zoo's
recurrent models at real lengths (the Shakespeare LSTM, a Conv1d + BatchNorm1d + bidirectional
GRU audio model over 100 frames). Packed sequences: `test_packed.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import zoo
from helpers.jaxprs import count_equations
from helpers.precision import assert_leaves_close, precisions, torch_value_and_grads
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

# The zoo's losses call `.long()` on int32 labels: JAX (x64 off) keeps them int32 and warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Explicitly requested dtype int64 requested in astype:UserWarning"
)


# name -> (module class, options, whether the initial state is given)
LAYERS: dict[str, tuple[Callable[..., nn.RNNBase], dict[str, Any], bool]] = {
    "lstm_2_layers_bidirectional": (nn.LSTM, {"num_layers": 2, "bidirectional": True}, False),
    "lstm_proj_batch_first_h0": (
        nn.LSTM,
        {"num_layers": 2, "proj_size": 3, "batch_first": True, "bidirectional": True},
        True,
    ),
    "gru_3_layers_bidirectional_h0": (nn.GRU, {"num_layers": 3, "bidirectional": True}, True),
    "gru_no_bias_batch_first": (nn.GRU, {"bias": False, "batch_first": True}, False),
    "rnn_tanh_2_layers_bidirectional": (nn.RNN, {"num_layers": 2, "bidirectional": True}, False),
    "rnn_relu_no_bias_h0": (nn.RNN, {"nonlinearity": "relu", "bias": False}, True),
}
TIME, BATCH, FEATURES, HIDDEN = 6, 3, 5, 4


def _layer(name: str, dtype: torch.dtype) -> tuple[nn.RNNBase, bool]:
    kind, options, with_state = LAYERS[name]
    torch.manual_seed(0)
    return kind(FEATURES, HIDDEN, **options).to(dtype), with_state


def _inputs(layer: nn.RNNBase, with_state: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """x, the probes the loss weighs outputs with, and (if `with_state`) h0 / c0."""
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, TIME) if layer.batch_first else (TIME, BATCH)
    directions = 2 if layer.bidirectional else 1
    out_size = (layer.proj_size or HIDDEN) * directions
    states = layer.num_layers * directions
    tensors = {
        "x": torch.randn(*shape, FEATURES, generator=g, dtype=dtype),
        "probe": torch.randn(*shape, out_size, generator=g, dtype=dtype),
    }
    if with_state:
        tensors["h0"] = torch.randn(states, BATCH, layer.proj_size or HIDDEN, generator=g)
        if isinstance(layer, nn.LSTM):
            tensors["c0"] = torch.randn(states, BATCH, HIDDEN, generator=g)
    return {k: v.to(dtype) for k, v in tensors.items()}


def _loss(layer: nn.RNNBase) -> Callable[[dict[str, Any], dict[str, Any]], Any]:
    """A smooth scalar of every output and final state: weighted outputs, squared states."""

    def loss(params: dict[str, Any], data: dict[str, Any]) -> Any:
        state = data.get("h0")
        if state is not None and isinstance(layer, nn.LSTM):
            state = (state, data["c0"])
        args = (data["x"],) if state is None else (data["x"], state)
        out, final = torch.func.functional_call(layer, params, args)
        finals = final if isinstance(final, tuple) else (final,)
        return (out * data["probe"]).sum() + sum((f * f).sum() for f in finals)

    return loss


def _jax(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda t: jnp.asarray(t.detach().numpy(), dtype=dtype), tree)


@pytest.mark.parametrize(("dtype", "rtol"), precisions(float64=1e-10, float32=5e-6))
@pytest.mark.parametrize("name", list(LAYERS))
def test_jit_value_and_grad_match_torch(name: str, dtype: torch.dtype, rtol: float) -> None:
    layer, with_state = _layer(name, dtype)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    data = _inputs(layer, with_state, dtype)
    loss = _loss(layer)
    step = jax.jit(jax.value_and_grad(bridge_mr.from_torch(loss), argnums=(0, 1)))
    value, (g_params, g_data) = step(_jax(params), _jax(data))
    want_value, want = torch_value_and_grads(loss, params, data)
    assert float(value) == pytest.approx(want_value, rel=rtol)
    assert_leaves_close({**g_params, **g_data}, want, rtol)


def test_vmap_and_an_eager_call_match_torch() -> None:
    layer, _ = _layer("lstm_proj_batch_first_h0", torch.float32)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    examples = [_inputs(layer, True, torch.float32) for _ in range(2)]
    examples[1] = {k: v.flip(0) for k, v in examples[1].items()}
    loss = _loss(layer)
    stacked = {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
    grads = jax.vmap(jax.grad(bridge_mr.from_torch(loss)), in_axes=(None, 0))(
        _jax(params), _jax(stacked)
    )
    for i, example in enumerate(examples):
        _, want = torch_value_and_grads(loss, params, example)
        assert_leaves_close({k: v[i] for k, v in grads.items()}, {k: want[k] for k in params}, 5e-6)
    eager = bridge_mr.from_torch(loss)(_jax(params), _jax(examples[0]))
    assert float(eager) == pytest.approx(torch_value_and_grads(loss, params, examples[0])[0])


def test_unbatched_input_matches_torch() -> None:
    torch.manual_seed(0)
    layer = nn.LSTM(FEATURES, HIDDEN, num_layers=2, bidirectional=True)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    g = torch.Generator().manual_seed(1)
    data = {
        "x": torch.randn(TIME, FEATURES, generator=g),  # [time, features]: no batch axis
        "probe": torch.randn(TIME, 2 * HIDDEN, generator=g),
    }
    loss = _loss(layer)
    value, grads = jax.jit(jax.value_and_grad(bridge_mr.from_torch(loss), argnums=(0, 1)))(
        _jax(params), _jax(data)
    )
    want_value, want = torch_value_and_grads(loss, params, data)
    assert float(value) == pytest.approx(want_value, rel=5e-6)
    assert_leaves_close({**grads[0], **grads[1]}, want, 5e-6)


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "chunks", "auto"])
def test_map_reduce_strategies_match_a_torch_loop(strategy: Any) -> None:
    layer, _ = _layer("gru_3_layers_bidirectional_h0", torch.float32)
    loss = _loss(layer)
    clients = [_inputs(layer, True, torch.float32) for _ in range(3)]
    clients[1] = {k: v * 0.5 for k, v in clients[1].items()}
    clients[2] = {k: v.flip(1) for k, v in clients[2].items()}
    stacked = {k: torch.stack([c[k] for c in clients]) for k in clients[0]}
    params = {k: v.detach().clone().requires_grad_() for k, v in layer.named_parameters()}
    converted = bridge_mr.from_torch(loss)
    chunk_size = 2 if strategy == "chunks" else None  # 3 clients: the last chunk is padded
    value = bridge_mr.map_reduce(
        converted, params, stacked, strategy=strategy, chunk_size=chunk_size
    )
    value.backward()
    results = [torch_value_and_grads(loss, params, c) for c in clients]
    assert value.item() == pytest.approx(np.mean([v for v, _ in results]), rel=5e-6)
    mean = {k: torch.stack([g[k] for _, g in results]).mean(0) for k in params}
    assert_leaves_close({k: p.grad for k, p in params.items()}, mean, 5e-6)  # type: ignore[misc]


def _stacked_lstm(dropout: float) -> tuple[nn.LSTM, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.LSTM(FEATURES, HIDDEN, num_layers=3, dropout=dropout)
    x = torch.randn(TIME, BATCH, FEATURES, generator=torch.Generator().manual_seed(1))
    return layer, {k: v.detach() for k, v in layer.named_parameters()}, x


def _outputs(layer: nn.LSTM) -> Callable[..., Any]:
    return lambda params, x: torch.func.functional_call(layer, params, (x,))[0]


def test_dropout_between_layers_draws_from_the_key() -> None:
    layer, params, x = _stacked_lstm(0.5)
    converted = jax.jit(bridge_mr.from_torch(_outputs(layer), rng=True))
    key = jax.random.key(0)
    first, again = converted(key, _jax(params), _jax(x)), converted(key, _jax(params), _jax(x))
    other = converted(jax.random.key(1), _jax(params), _jax(x))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.allclose(np.asarray(first), np.asarray(other))
    # Dropout 1 zeroes the inputs of layers 2 and 3: deterministic, so equal to torch's.
    layer, params, x = _stacked_lstm(1.0)
    got = bridge_mr.from_torch(_outputs(layer), rng=True)(key, _jax(params), _jax(x))
    np.testing.assert_allclose(np.asarray(got), _outputs(layer)(params, x).detach(), atol=1e-6)
    # Evaluation mode does not drop (and needs no key).
    layer.eval()
    got = bridge_mr.from_torch(_outputs(layer))(_jax(params), _jax(x))
    np.testing.assert_allclose(np.asarray(got), _outputs(layer)(params, x).detach(), atol=1e-6)


def test_dropout_without_a_key_says_to_convert_with_rng() -> None:
    layer, params, x = _stacked_lstm(0.5)
    with pytest.raises(UnsupportedTorchOperation, match="rng=True"):
        bridge_mr.from_torch(_outputs(layer))(_jax(params), _jax(x))


def test_the_traced_program_does_not_grow_with_the_sequence_length() -> None:
    model = zoo.gru_classifier()
    params = _jax({k: v.detach() for k, v in model.named_parameters()})
    step = jax.value_and_grad(bridge_mr.from_torch(zoo.sequence_loss(model)))

    def equations(length: int) -> int:
        x, y = jnp.zeros((2, length, 16)), jnp.zeros((2,), jnp.int32)
        jaxpr = jax.make_jaxpr(step)(params, x, y)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert {e.params["length"] for e in scans} == {length}, "no scan over time"
        return count_equations(jaxpr)

    equations(3)  # The first trace of a process also holds torchax's one-off key creation.
    assert equations(10) == equations(200)


def test_a_cell_as_the_body_of_a_jax_scan_matches_torchs_loop() -> None:
    torch.manual_seed(0)
    cell = nn.LSTMCell(FEATURES, HIDDEN)
    params = {k: v.detach() for k, v in cell.named_parameters()}
    x = torch.randn(TIME, BATCH, FEATURES, generator=torch.Generator().manual_seed(1))

    def step(p: dict[str, Any], x_t: Any, h: Any, c: Any) -> Any:
        return torch.func.functional_call(cell, p, (x_t, (h, c)))

    def torch_loss(p: dict[str, Any], data: dict[str, Any]) -> Any:
        h = c = torch.zeros(BATCH, HIDDEN, dtype=data["x"].dtype)
        for x_t in data["x"]:
            h, c = step(p, x_t, h, c)
        return (h * h).sum() + c.sum()

    converted = bridge_mr.from_torch(step)

    def jax_loss(p: Any, x: Any) -> Any:
        def body(state: Any, x_t: Any) -> Any:
            return converted(p, x_t, *state), None

        zeros = jnp.zeros((BATCH, HIDDEN))
        (h, c), _ = jax.lax.scan(body, (zeros, zeros), x)
        return (h * h).sum() + c.sum()

    step_jaxpr = jax.make_jaxpr(jax_loss)(_jax(params), _jax(x))
    assert [e.params["length"] for e in step_jaxpr.eqns if e.primitive.name == "scan"] == [TIME]
    value, grads = jax.jit(jax.value_and_grad(jax_loss))(_jax(params), _jax(x))
    want_value, want = torch_value_and_grads(torch_loss, params, {"x": x})
    assert float(value) == pytest.approx(want_value, rel=5e-6)
    assert_leaves_close(grads, {k: want[k] for k in params}, 5e-6)


class AudioConvGRU(nn.Module):
    """Log-mel frames [batch, 40, frames] -> Conv1d (stride 2) + BatchNorm1d + GELU ->
    bidirectional GRU 48 over the frames -> mean over time -> 12 keyword classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(40, 32, kernel_size=5, stride=2, padding=2)
        self.norm = nn.BatchNorm1d(32)
        self.gru = nn.GRU(32, 48, batch_first=True, bidirectional=True)
        self.head = nn.Linear(96, 12)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        features = nn.functional.gelu(self.norm(self.conv(mel)))
        out, _ = self.gru(features.transpose(1, 2))
        return self.head(out.mean(1))


@pytest.mark.slow
def test_the_shakespeare_lstm_matches_torch_at_80_characters() -> None:
    model = zoo.shakespeare_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    text = torch.randint(0, 80, (2, 81), generator=torch.Generator().manual_seed(2))
    x, y = text[:, :-1], text[:, 1:]
    loss = zoo.sequence_loss(model)
    value, grads = jax.jit(jax.value_and_grad(bridge_mr.from_torch(loss)))(
        _jax(params), _jax(x, jnp.int32), _jax(y, jnp.int32)
    )
    model.double()
    doubled = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    want = loss(doubled, x, y)
    want.backward()
    assert float(value) == pytest.approx(want.item(), rel=1e-5)
    assert_leaves_close(grads, {k: v.grad for k, v in doubled.items()}, 5e-6)  # type: ignore[misc]


# Float32: 1.6e-5 measured (BatchNorm statistics and convolution gradients in float32, see
# test_model_zoo.py; the float64 leg shows both sides compute the same).
@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "rtol"), precisions(float64=1e-9, float32=1e-4))
def test_the_audio_model_over_100_frames_matches_a_torch_loop_in_map_reduce(
    dtype: torch.dtype, rtol: float
) -> None:
    torch.manual_seed(0)
    model = AudioConvGRU().to(dtype)
    mel = torch.randn(4, 3, 40, 200, generator=torch.Generator().manual_seed(3), dtype=dtype)
    labels = torch.randint(0, 12, (4, 3), generator=torch.Generator().manual_seed(4))
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def loss(p: dict[str, Any], b: dict[str, Any], batch: dict[str, Any]) -> Any:
        logits = torch.func.functional_call(model, {**p, **b}, (batch["mel"],))
        return nn.functional.cross_entropy(logits, batch["label"].long())

    converted = bridge_mr.from_torch(loss, mutable=1)
    value, new_buffers = bridge_mr.map_reduce(
        lambda server, client: converted(server["p"], server["b"], client),
        {"p": params, "b": buffers},
        {"mel": mel, "label": labels},
    )
    value.backward()
    values, grads, after = [], [], []
    for c in range(4):
        p = {k: v.detach().double().requires_grad_() for k, v in params.items()}
        b = {k: (v.double() if v.is_floating_point() else v).clone() for k, v in buffers.items()}
        v = loss(p, b, {"mel": mel[c].double(), "label": labels[c]})
        v.backward()
        values.append(v.item())
        grads.append({k: t.grad for k, t in p.items()})
        after.append(b)
    assert value.item() == pytest.approx(np.mean(values), rel=rtol)
    mean_grads = {k: torch.stack([g[k] for g in grads]).mean(0) for k in params}
    assert_leaves_close({k: t.grad for k, t in params.items()}, mean_grads, rtol)  # type: ignore[misc]
    stats = ("norm.running_mean", "norm.running_var")
    want = {k: torch.stack([b[k] for b in after]).mean(0) for k in stats}
    assert_leaves_close({k: new_buffers[k].detach() for k in stats}, want, rtol)
