"""`bridge_mr.from_torch`: values known only when the program runs. A Python bool of a traced
value is refused under `jit` naming the line and the ways out (eager calls read it); libraries
that ask whether they are traced (`tensor.jax()`) are told so under `jit` only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


def test_a_python_bool_of_a_traced_value_names_the_line_and_the_way_out() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():  # a data-dependent Python branch
            return x
        return -x

    x = jnp.ones(3)
    np.testing.assert_array_equal(np.asarray(bridge_mr.from_torch(fn)(x)), np.ones(3))  # eager
    with pytest.raises(
        UnsupportedTorchOperation,
        match=r"test_traced_values\.py:\d+ \(fn: if \(x > 0\)\.all\(\):.*reads a traced value as a "
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
