"""CPU tensors whose program runs on another device (an accelerator's path, taken on the CPU's
second device here): the inputs go there once per call, the exported outputs come back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import chip

from bridge_mr import dlpack, runners
from bridge_mr.runners import _dlpack as dlpack_runner

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


def test_large_inputs_whose_shape_a_tpu_would_pad_cross_as_dense_2d_arrays(monkeypatch):
    """Images [.., 3, 32, 32] would cross in padded (8, 128) tiles on a TPU: they cross as a
    [size / 1024, 1024] view (of a row-major copy where they are not contiguous: permuted,
    expanded) and the program reshapes them back; dense or small inputs cross as they are.
    Values stay exact whichever way the images came, call after call; a tensor of another
    shape is refused, named."""
    device = jax.devices("cpu")[1]
    shapes = [(96, 3, 32, 32), (8, 128), (128, 256)]  # 1.1 MiB of images: above 1 MiB
    avals = [(s, F32) for s in shapes]

    def program(images, w, dense):
        return [images.sum(axis=(1, 2)) @ dense[:32, :8] + w.sum(), images[:, 2] * 2]

    run = runners.runner_for("cpu", jax.jit(program), avals, 2, None, device=device)
    crossed = chip.crossed_shapes(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    forms = {
        "contiguous": lambda: torch.randn(96, 3, 32, 32, generator=gen),
        "permuted": lambda: torch.randn(96, 32, 32, 3, generator=gen).permute(0, 3, 1, 2),
        "expanded": lambda: torch.randn(1, 3, 32, 32, generator=gen).expand(96, 3, 32, 32),
    }
    for form in ("contiguous", "permuted", "expanded", "contiguous"):
        images = forms[form]()
        w, dense = torch.randn(8, 128, generator=gen), torch.randn(128, 256, generator=gen)
        crossed.clear()
        out, _ = run([images, w, dense], [])
        want = program(images.numpy(), w.numpy(), dense.numpy())
        np.testing.assert_allclose(out[0].numpy(), want[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(out[1], images[:, 2] * 2)
        assert (96 * 3 * 32 * 32 // 1024, 1024) in crossed, form
        assert (128, 256) in crossed  # dense already: as it is
    wrong = torch.zeros(48, 6, 32, 32)  # as many elements, another shape
    with pytest.raises(ValueError, match=r"tensors\[0\]: expected a tensor of shape"):
        run([wrong, w, dense], [])


def test_large_outputs_whose_shape_a_tpu_would_pad_come_back_as_dense_2d_arrays(monkeypatch):
    """An exported output of images' shape is reshaped to [size / 1024, 1024] in the program,
    comes back so, and is the same memory in its own shape on the host, not a view (torch
    refuses in-place changes to a view that an autograd Function returns); exact values, call
    after call; small or dense outputs and what stays on the device (carried) keep their shapes.
    An input of another shape, which would change the output's, is refused, named."""
    device = jax.devices("cpu")[1]
    shape, dense = (96, 3, 32, 32), (96 * 3 * 32 * 32 // 1024, 1024)

    def program(images, w):
        return [images * 2 + w[0, 0], images.sum(axis=0), w + 1, images - 1]

    avals = [(shape, F32), ((256, 1024), F32)]
    run = runners.runner_for("cpu", jax.jit(program), avals, 3, None, device=device)
    crossed = chip.crossed_shapes(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        images, w = torch.randn(shape, generator=gen), torch.randn(256, 1024, generator=gen)
        crossed.clear()
        out, carried = run([images, w], [])
        assert out[0].shape == shape
        assert out[0].is_contiguous()
        assert out[0]._base is None
        assert torch.equal(out[0], images * 2 + w[0, 0])
        torch.testing.assert_close(out[1], images.sum(dim=0), rtol=1e-5, atol=1e-4)  # its order
        assert torch.equal(out[2], w + 1)
        assert crossed.count(dense) == 2, crossed  # the images going, the output coming back
        assert (3, 32, 32) in crossed  # small: as it is
        assert (256, 1024) in crossed  # dense already: as it is
        assert carried[0].shape == shape
        assert carried[0].devices() == {device}
        assert np.array_equal(np.asarray(carried[0]), images.numpy() - 1)
    # An input that crosses as it is (dense already) is not checked: the output's shape is, when
    # jax.jit retraces (without programs on disk; a program from disk refuses other shapes).
    monkeypatch.setenv("BRIDGE_MR_COMPILATION_CACHE", "0")
    run = runners.runner_for(
        "cpu", jax.jit(lambda x: [x[..., None]]), [((512, 1024), F32)], 1, None, device=device
    )
    assert run([torch.ones(512, 1024)], [])[0][0].shape == (512, 1024, 1)
    with pytest.raises(ValueError, match=r"outputs\[0\]: the runner's first call made it"):
        run([torch.ones(1024, 512)], [])


def test_a_permuted_input_computes_right_on_another_device():
    """A permuted (NHWC stored, NCHW seen) input crosses row-major: shared in its own layout
    and put on another device, jaxlib 0.10.2 computed on it as if row-major."""
    device = jax.devices("cpu")[1]
    run = runners.runner_for(
        "cpu", jax.jit(lambda x: [x[:, 2] * 2]), [((8, 3, 16, 16), F32)], 1, None, device=device
    )
    images = torch.randn(8, 16, 16, 3).permute(0, 3, 1, 2)
    for _ in range(2):
        assert torch.equal(run([images], [])[0][0], images[:, 2] * 2)


def test_the_dense_crossing_shape_of_an_input():
    f32, bf16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
    assert dlpack_runner.crossing_shape((50, 5, 10, 3, 32, 32), f32) == (7500, 1024)
    assert dlpack_runner.crossing_shape((1 << 18,), f32) == (256, 1024)  # 1-D
    assert dlpack_runner.crossing_shape((300, 10, 128), f32) == (375, 1024)  # 10 rows: padded
    assert dlpack_runner.crossing_shape((100, 8, 384), f32) is None  # dense tiles
    assert dlpack_runner.crossing_shape((200, 8, 640), bf16) == (1000, 1024)  # bf16: 16 rows
    assert dlpack_runner.crossing_shape((3, 32, 32), f32) is None  # small: as it is
    assert dlpack_runner.crossing_shape((262147,), f32) is None  # no width divides it
    assert dlpack_runner.crossing_shape((1031, 2, 128), f32) == (1031, 256)  # 1031 is odd
    assert dlpack_runner.crossing_shape((2049, 128), f32) is None  # 7 rows: padded by 0.3%
    assert dlpack_runner.crossing_shape((50257, 768), f32) is None  # GPT-2's wte: by 0.01%
    assert dlpack_runner.crossing_shape((1000, 1000), f32) is None  # 1,024 lanes: by 2.4%
    assert dlpack_runner.crossing_shape((4000, 100), f32) == (3125, 128)  # 100 lanes of 128
