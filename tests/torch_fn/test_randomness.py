"""`bridge_mr.from_torch` with random ops: dropout draws from the JAX key (`rng=True`) per
client and step, eval mode needs none, random ops without a key are refused; the keys it takes,
and `client_keys`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.from_torch import ATOL, RTOL, close
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


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
    close(converted(params, jnp.asarray(x.numpy())), model(x), "eval dropout")


def test_random_ops_without_a_key_are_a_clear_error() -> None:
    torch.manual_seed(0)
    model = Dropout()
    converted = bridge_mr.from_torch(lambda s, x: torch.func.functional_call(model, s, (x,)))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    with pytest.raises(UnsupportedTorchOperation, match=r"rng=True.*torch.manual_seed|manual_seed"):
        converted(params, jnp.ones((2, 12)))
    noisy = bridge_mr.from_torch(lambda x: x + torch.randn(x.shape))
    with pytest.raises(UnsupportedTorchOperation, match=r"test_randomness.py:\d+"):
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
