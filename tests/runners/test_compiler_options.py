"""runners.runner_for(compiler_options=...): the options reach the program XLA compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge_mr import runners

OPTION = "xla_cpu_experimental_ynn_fusion_type"
F32 = np.dtype("float32")


def _total(*xs):
    return [sum(jnp.tanh(x).sum() for x in xs)]


# Small inputs share one packed buffer (the runner wraps the program to unpack them); a large
# one crosses alone (the runner compiles the program itself).
@pytest.mark.parametrize("shapes", [[(4,), (3,)], [(256, 256)]], ids=["packed", "alone"])
def test_a_cpu_runner_compiles_with_the_options_it_is_given(shapes):
    avals = [(shape, F32) for shape in shapes]
    tensors = [torch.full(shape, 0.5) for shape in shapes]
    good = runners.runner_for("cpu", jax.jit(_total), avals, 1, None, compiler_options={OPTION: ""})
    (total,), _ = good(tensors, [])
    want = sum(np.tanh(np.float32(0.5)) * np.prod(shape) for shape in shapes)
    np.testing.assert_allclose(total.item(), want, rtol=1e-5)
    bad = runners.runner_for(
        "cpu", jax.jit(_total), avals, 1, None, compiler_options={OPTION: "no_such_type"}
    )
    with pytest.raises(Exception, match="no_such_type"):  # So XLA saw the options.
        bad(tensors, [])
