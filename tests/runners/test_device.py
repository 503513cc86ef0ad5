"""CPU tensors whose program runs on another device (an accelerator's path, taken on the CPU's
second device here): the inputs go there once per call, the exported outputs come back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr import dlpack, runners

F32 = np.dtype("float32")


def _program(x, w, big):
    return [x @ w + big.mean(), jnp.tanh(x)]


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 4, generator=gen),
        torch.randn(4, 2, generator=gen).t().contiguous().t(),  # column-major
        torch.randn(128, 256, generator=gen),  # crosses alone, not packed
    ]


def test_inputs_go_to_the_device_and_exported_outputs_come_back_to_the_host():
    device = jax.devices("cpu")[1]
    avals = [(tuple(t.shape), F32) for t in _inputs(0)]
    run = runners.runner_for("cpu", jax.jit(_program), avals, 1, None, device=device)
    for seed in (0, 1, 2):  # the first call, then the kept program with new values
        tensors = _inputs(seed)
        exported, carried = run(tensors, [])
        x, w, big = (t.double() for t in tensors)
        torch.testing.assert_close(exported[0], (x @ w + big.mean()).float(), rtol=1e-5, atol=1e-5)
        assert exported[0].device == torch.device("cpu")
        # What stays in JAX (a carried value) lives where the program ran.
        assert carried[0].devices() == {device}
        np.testing.assert_allclose(np.asarray(carried[0]), np.tanh(tensors[0].numpy()), rtol=1e-6)


def test_host_tensors_run_on_the_cpu_where_jax_default_device_is_a_cpu():
    assert dlpack.host_program_device() is None  # no accelerator in this process
    with jax.default_device(jax.devices("cpu")[1]):
        assert dlpack.host_program_device() is None
    assert dlpack.host_device() == jax.devices("cpu")[0]
