"""The TorchTPU runner's refusals, which need no chip (tests/tpu/test_torch_tpu.py runs it on one):
JAX must be kept to the CPU beside TorchTPU, torch_tpu must be a version bridge_mr was checked on,
and a round of "tpu" tensors runs on one chip, without a JAX mesh or several processes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import jax
import numpy as np
import pytest

from bridge_mr import runners

AVALS = [((3,), np.dtype("float32"))]


def _program(x: jax.Array) -> list[jax.Array]:
    return [x + 1]


@pytest.fixture
def jax_platforms() -> Iterator[None]:
    before = jax.config.values.get("jax_platforms")
    yield
    jax.config.update("jax_platforms", before)


@pytest.mark.parametrize("platforms", [None, "tpu,cpu", "tpu"])
def test_jax_must_stay_on_the_cpu_beside_torch_tpu(jax_platforms: None, platforms: str | None):
    jax.config.update("jax_platforms", platforms)
    with pytest.raises(RuntimeError, match=r"JAX_PLATFORMS=cpu .* before Python starts"):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, None)


def test_without_torch_tpu_the_runner_says_what_to_install(jax_platforms: None):
    if importlib.util.find_spec("torch_tpu") is not None:
        pytest.skip("torch_tpu is installed here: the TorchTPU leg runs this runner")
    jax.config.update("jax_platforms", "cpu")
    with pytest.raises(ImportError, match=r"found torch_tpu none\. Install `pip install "):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, None)


def test_a_mesh_is_refused_for_tpu_tensors():
    mesh = jax.make_mesh((2,), ("clients",))
    with pytest.raises(NotImplementedError, match="TorchTPU tensors run a round on one chip"):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, mesh)
