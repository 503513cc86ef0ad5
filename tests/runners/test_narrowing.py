"""The CPU runner with 64-bit integer tensors while x64 is off: narrowed, counted, named."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge_mr import dlpack, runners

F32, I32 = np.dtype("float32"), np.dtype("int32")


def _picks(*xs):
    """Each float input indexed by the int input after it (a gather, as labels are used)."""
    return [jnp.stack([x[i].sum() for x, i in zip(xs[::2], xs[1::2], strict=True)])]


def _inputs(index_dtype: torch.dtype) -> list[torch.Tensor]:
    # Small enough that the runner packs the float inputs into one buffer.
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, generator=gen) for _ in range(3)]
    ids = [torch.tensor(ix, dtype=index_dtype) for ix in ([0, 4], [1, 1, 3], [2])]
    return [t for pair in zip(xs, ids, strict=True) for t in pair]


def test_small_int64_inputs_narrow_alone_and_match_int32_ones() -> None:
    avals = [(tuple(t.shape), I32 if i % 2 else F32) for i, t in enumerate(_inputs(torch.int32))]
    with jax.enable_x64(False):
        run = runners.runner_for("cpu", jax.jit(_picks), avals, 1, None)
        (want,), _ = run(_inputs(torch.int32), [])
        with dlpack.count_conversions() as stats:
            (got,), _ = run(_inputs(torch.int64), [])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # One checked copy per int64 tensor (2 + 3 + 1 values of 4 bytes); the floats are shared.
    assert (stats.copies, stats.bytes_copied) == (3, 6 * 4)


def test_an_out_of_range_input_is_named_as_the_runner_was_told() -> None:
    tensors = _inputs(torch.int64)
    tensors[3] = torch.tensor([1, 2**31, 0])
    avals = [(tuple(t.shape), I32 if i % 2 else F32) for i, t in enumerate(tensors)]
    names = [f"arg {i}" for i in range(len(tensors))]
    with jax.enable_x64(False):
        named = runners.runner_for("cpu", jax.jit(_picks), avals, 1, None, names=names)
        with pytest.raises(ValueError, match=re.escape("arg 3: a torch.int64 tensor")):
            named(tensors, [])
        unnamed = runners.runner_for("cpu", jax.jit(_picks), avals, 1, None)
        with pytest.raises(ValueError, match=re.escape("tensors[3]: a torch.int64 tensor")):
            unnamed(tensors, [])
