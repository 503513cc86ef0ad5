"""`from_torch` of packed sequences: `pack_padded_sequence` -> `nn.LSTM` / `nn.GRU` / `nn.RNN`
-> `pad_packed_sequence` and the final states, as a masked scan over the padded batch.

Values and gradients against torch autograd on the same packed code: float64 at 1e-10, float32
against float64 torch leaf by leaf at 5e-6 (as `test_recurrent.py`), under jit, vmap and
map_reduce, with lengths traced (an argument) or a Python list, sorted or not. Then what is
refused: the packed data or batch sizes read, lengths torch rejects, unpacking traced lengths
without `total_length`, a PackedSequence built by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.precision import assert_leaves_close, precisions, torch_value_and_grads
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

pytestmark = pytest.mark.filterwarnings(
    "ignore:Explicitly requested dtype int64 requested in:UserWarning"
)

TIME, BATCH, FEATURES, HIDDEN = 5, 3, 4, 3

# name -> (module class, options, initial state given, lengths as a list (else an argument),
# enforce_sorted, the lengths)
CASES: dict[str, tuple[Callable[..., nn.RNNBase], dict[str, Any], bool, bool, bool, list[int]]] = {
    "lstm_bidirectional_batch_first_h0_unsorted": (
        nn.LSTM,
        {"num_layers": 2, "bidirectional": True, "batch_first": True},
        True,
        False,
        False,
        [2, 5, 3],
    ),
    "lstm_proj_sorted_list": (nn.LSTM, {"proj_size": 2}, False, True, True, [5, 4, 1]),
    "gru_bidirectional_unsorted_list": (
        nn.GRU,
        {"num_layers": 2, "bidirectional": True},
        False,
        True,
        False,
        [3, 1, 4],
    ),
    "rnn_relu_batch_first_h0_sorted": (
        nn.RNN,
        {"nonlinearity": "relu", "batch_first": True, "bidirectional": True},
        True,
        False,
        True,
        [4, 4, 2],
    ),
}


def _jax(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda t: jnp.asarray(t.detach().numpy(), dtype=dtype), tree)


def _setup(name: str, dtype: torch.dtype) -> tuple[nn.RNNBase, dict[str, torch.Tensor]]:
    """The layer and its data: x, the output probe, h0 / c0 where given, the lengths."""
    kind, options, with_state, _, _, lengths = CASES[name]
    torch.manual_seed(0)
    layer = kind(FEATURES, HIDDEN, **options).to(dtype)
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, TIME) if layer.batch_first else (TIME, BATCH)
    directions = 2 if layer.bidirectional else 1
    out = layer.proj_size or HIDDEN
    data = {
        "x": torch.randn(*shape, FEATURES, generator=g),
        "probe": torch.randn(*shape, out * directions, generator=g),
    }
    if with_state:
        data["h0"] = torch.randn(layer.num_layers * directions, BATCH, out, generator=g)
        if isinstance(layer, nn.LSTM):
            data["c0"] = torch.randn(layer.num_layers * directions, BATCH, HIDDEN, generator=g)
    data = {k: v.to(dtype) for k, v in data.items()}
    data["lengths"] = torch.tensor(lengths)
    return layer, data


def _loss(name: str, layer: nn.RNNBase) -> Callable[..., Any]:
    """Weighted padded outputs (padding -1 past each length), squared final states."""
    _, _, _, as_list, enforce_sorted, listed = CASES[name]

    def loss(params: dict[str, Any], data: dict[str, Any]) -> Any:
        lengths = listed if as_list else data["lengths"]
        x = data["x"]
        packed = pack_padded_sequence(x, lengths, layer.batch_first, enforce_sorted)
        state = data.get("h0")
        if state is not None and isinstance(layer, nn.LSTM):
            state = (state, data["c0"])
        args = (packed,) if state is None else (packed, state)
        out, final = torch.func.functional_call(layer, params, args)
        time = x.size(1) if layer.batch_first else x.size(0)
        out, out_lengths = pad_packed_sequence(
            out, layer.batch_first, padding_value=-1.0, total_length=time
        )
        finals = final if isinstance(final, tuple) else (final,)
        value = (out * data["probe"]).sum() + sum((f * f).sum() for f in finals)
        return value + (out_lengths * 0.25).sum()

    return loss


def _floats(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: v for k, v in data.items() if k != "lengths"}, {"lengths": data["lengths"]}


@pytest.mark.parametrize(("dtype", "rtol"), precisions(float64=1e-10, float32=5e-6))
@pytest.mark.parametrize("name", list(CASES))
def test_jit_value_and_grad_match_torch(name: str, dtype: torch.dtype, rtol: float) -> None:
    layer, data = _setup(name, dtype)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    loss = _loss(name, layer)
    converted = bridge_mr.from_torch(lambda p, f, i: loss(p, {**f, **i}))
    floats, ints = _floats(data)
    step = jax.jit(jax.value_and_grad(converted, argnums=(0, 1)))
    value, (g_params, g_data) = step(_jax(params), _jax(floats), _jax(ints, jnp.int32))
    want_value, want = torch_value_and_grads(loss, params, data)
    assert float(value) == pytest.approx(want_value, rel=rtol)
    assert_leaves_close({**g_params, **g_data}, want, rtol)


def test_traced_unsorted_lengths_with_enforce_sorted_give_the_unsorted_result() -> None:
    """torch raises for them; traced, they cannot be checked, and the masked scan needs no
    order: the result is torch's with enforce_sorted=False (documented in _packed.py)."""
    torch.manual_seed(0)
    layer = nn.GRU(FEATURES, HIDDEN, bidirectional=True)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def final(p: dict[str, Any], x: Any, lengths: Any, enforce_sorted: bool) -> Any:
        packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
        return torch.func.functional_call(layer, p, (packed,))[1]

    x, lengths = torch.randn(TIME, BATCH, FEATURES), torch.tensor([2, 5, 3])
    converted = jax.jit(bridge_mr.from_torch(lambda p, x, n: final(p, x, n, True)))
    got = converted(_jax(params), _jax(x), _jax(lengths, jnp.int32))
    want = final(params, x, lengths, False).detach().numpy()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


class Classifier(nn.Module):
    """The common classifier: the last state of each sequence (at its length) -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


torch.manual_seed(0)
CLASSIFIER = Classifier()


def _classifier_loss(params: dict[str, Any], data: dict[str, Any]) -> Any:
    logits = torch.func.functional_call(CLASSIFIER, params, (data["x"], data["lengths"]))
    return nn.functional.cross_entropy(logits, data["label"].long())


def _classifier_data(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(BATCH, TIME, FEATURES, generator=g),
        "lengths": torch.randint(1, TIME + 1, (BATCH,), generator=g),
        "label": torch.randint(0, 2, (BATCH,), generator=g),
    }


def _classifier_params() -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in CLASSIFIER.named_parameters()}


def _client_grads(clients: list[dict[str, torch.Tensor]]) -> list[tuple[float, dict[str, Any]]]:
    params = _classifier_params()
    results = []
    for client in clients:
        value, grads = torch_value_and_grads(_classifier_loss, params, client)
        results.append((value, {k: grads[k] for k in params}))
    return results


def test_vmap_over_examples_with_their_own_lengths_matches_torch() -> None:
    examples = [_classifier_data(seed) for seed in (2, 3)]
    stacked = {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
    grad = jax.grad(bridge_mr.from_torch(_classifier_loss))
    grads = jax.jit(jax.vmap(grad, in_axes=(None, 0)))(
        _jax(_classifier_params()), _jax(stacked, None)
    )
    for i, (_, want) in enumerate(_client_grads(examples)):
        assert_leaves_close({k: v[i] for k, v in grads.items()}, want, 5e-6)


@pytest.mark.parametrize("strategy", ["vmap", "chunks"])
def test_map_reduce_matches_a_torch_loop(strategy: Any) -> None:
    clients = [_classifier_data(seed) for seed in (4, 5, 6)]
    stacked = {k: torch.stack([c[k] for c in clients]) for k in clients[0]}
    params = {k: v.clone().requires_grad_() for k, v in _classifier_params().items()}
    value = bridge_mr.map_reduce(
        bridge_mr.from_torch(_classifier_loss),
        params,
        stacked,
        strategy=strategy,
        chunk_size=2 if strategy == "chunks" else None,  # the last chunk is padded
    )
    value.backward()
    results = _client_grads(clients)
    assert value.item() == pytest.approx(np.mean([v for v, _ in results]), rel=5e-6)
    mean = {k: torch.stack([g[k] for _, g in results]).mean(0) for k in params}
    assert_leaves_close({k: p.grad for k, p in params.items()}, mean, 5e-6)  # type: ignore[misc]


def test_pack_sequence_and_a_round_trip_match_torch_eager_and_jitted() -> None:
    torch.manual_seed(0)
    layer = nn.GRU(FEATURES, HIDDEN)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def fn(p: dict[str, Any], x: Any) -> Any:
        packed = pack_sequence([x[:4, 0], x[:, 1], x[:2, 2]], enforce_sorted=False)
        out, h = torch.func.functional_call(layer, p, (packed,))
        # pad_packed_sequence's default length: the longest, known from a list's lengths.
        out, lengths = pad_packed_sequence(out, padding_value=2.0)
        # A round trip without the layer pads past each length, to a longer total length.
        back, _ = pad_packed_sequence(
            pack_padded_sequence(x, [3, 5, 1], enforce_sorted=False), True, -1.0, TIME + 2
        )
        return out, h, lengths, back

    x = torch.randn(TIME, BATCH, FEATURES)
    wants = fn(params, x)
    for converted in (bridge_mr.from_torch(fn), jax.jit(bridge_mr.from_torch(fn))):
        for got, want in zip(converted(_jax(params), _jax(x)), wants, strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), atol=1e-6)


def test_pad_sequence_matches_torch() -> None:
    """What pack_sequence pads with, on its own (torch's kernel came out as padding only)."""

    def fn(x: Any) -> Any:
        sequences = [x[:4, 0], x[:, 1], x[:2, 2]]
        return (
            nn.utils.rnn.pad_sequence(sequences),
            nn.utils.rnn.pad_sequence(sequences, True, 7.0, "left"),
        )

    x = torch.randn(TIME, BATCH, FEATURES)
    for got, want in zip(jax.jit(bridge_mr.from_torch(fn))(_jax(x)), fn(x), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want.numpy())


def test_the_packed_layer_is_one_masked_scan_over_time() -> None:
    layer = nn.GRU(FEATURES, HIDDEN)
    params = _jax({k: v.detach() for k, v in layer.named_parameters()})

    def fn(p: dict[str, Any], x: Any, lengths: Any) -> Any:
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        return torch.func.functional_call(layer, p, (packed,))[1].sum()

    jaxpr = jax.make_jaxpr(bridge_mr.from_torch(fn))(
        params, jnp.zeros((40, BATCH, FEATURES)), jnp.ones((BATCH,), jnp.int32)
    )
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [40]


def _refused(fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(UnsupportedTorchOperation) as raised:
        jax.jit(bridge_mr.from_torch(fn))(*args)
    message = str(raised.value)
    assert "test_packed.py" in message, message
    assert "Fix: " in message, message
    return message


def test_reading_the_packed_data_or_batch_sizes_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    layer = nn.GRU(FEATURES, HIDDEN)
    params = _jax({k: v.detach() for k, v in layer.named_parameters()})
    x, lengths = jnp.ones((TIME, BATCH, FEATURES)), jnp.asarray([5, 3, 2])

    def packed_output(p: dict[str, Any], x: Any, lengths: Any) -> Any:
        return torch.func.functional_call(layer, p, (pack_padded_sequence(x, lengths),))[0]

    uses: dict[str, Callable[[Any], Any]] = {
        "packed.data.sum": lambda packed: packed.data.sum(),
        "mul of packed.data": lambda packed: torch.ones(2) * packed.data,
        "packed.batch_sizes[1]": lambda packed: packed.batch_sizes[1],
        "len(packed.batch_sizes)": lambda packed: len(packed.batch_sizes),
        "packed.data.to": lambda packed: packed.to(torch.float64),
        "packed.data.size(0)": lambda packed: packed.data.size(0),
    }
    for what, use in uses.items():
        message = _refused(lambda p, x, n, use=use: use(packed_output(p, x, n)), params, x, lengths)
        assert what in message, message
        assert "Fix: unpack with nn.utils.rnn.pad_packed_sequence" in message, message


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([5, 0, 2], "lengths [5, 0, 2] (expected each in 1..5"),
        ([6, 3, 2], "lengths [6, 3, 2] (expected each in 1..5"),
        ([2, 5, 3], "not in decreasing order and enforce_sorted=True"),
        ([5, 3], "lengths of shape (2,) for a batch of 3"),
    ],
)
def test_lengths_torch_rejects_are_refused(lengths: list[int], expected: str) -> None:
    def fn(x: Any) -> Any:
        return pad_packed_sequence(pack_padded_sequence(x, lengths))[0]

    assert expected in _refused(fn, jnp.ones((TIME, BATCH, FEATURES)))


def test_unpacking_traced_lengths_needs_a_total_length_of_the_padded_length() -> None:
    def fn(x: Any, lengths: Any, total_length: int | None) -> Any:
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        return pad_packed_sequence(packed, total_length=total_length)[0]

    x, lengths = jnp.ones((TIME, BATCH, FEATURES)), jnp.asarray([5, 3, 2])
    message = _refused(lambda x, n: fn(x, n, None), x, lengths)
    assert "without total_length" in message, message
    assert "total_length=5" in message, message
    message = _refused(lambda x, n: fn(x, n, TIME - 1), x, lengths)
    assert "pad_packed_sequence(total_length=4) of traced lengths" in message, message


def test_a_packed_sequence_made_by_hand_is_refused() -> None:
    layer = nn.GRU(FEATURES, HIDDEN)
    params = _jax({k: v.detach() for k, v in layer.named_parameters()})

    def by_hand(params: dict[str, Any], x: Any) -> Any:
        # What nn.GRU calls on a PackedSequence of real tensors (torch's own packing here is
        # the stand-ins; data and batch sizes as tensors come only from code that builds them).
        names = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
        weights = [params[name] for name in names]
        data, batch_sizes = x.flatten(0, 1), torch.tensor([2] * TIME)
        h0 = torch.zeros(1, 2, HIDDEN)
        return torch.gru(data, batch_sizes, h0, weights, True, 1, 0.0, False, False)[1].sum()

    message = _refused(by_hand, params, jnp.ones((TIME, 2, FEATURES)))
    assert "nn.GRU on a PackedSequence made by hand" in message, message
    assert "Fix: build it with nn.utils.rnn.pack_padded_sequence" in message, message
