"""`bridge_mr.from_torch` refuses at trace time what it cannot lower, naming the op, the line and
the fix: an op with no lowering, a captured tensor, a write to an argument not declared
`mutable=`, bad options and inputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


def test_an_op_without_a_lowering_names_the_op_and_the_source_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._cdist_backward(x, x, x, 2.0, x)  # no JAX lowering

    with pytest.raises(UnsupportedTorchOperation) as info:
        bridge_mr.from_torch(fn)(jnp.ones((2, 2)))
    message = str(info.value)
    assert "_cdist_backward" in message
    assert "unsupported in the JAX lowering" in message
    assert "test_refusals.py:" in message
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
