"""Random shapes, strides, offsets and dtypes: zero copy exactly when compact and aligned."""

from __future__ import annotations

import numpy as np
import torch
from dlpack_cases import dtypes_for_this_mode, values
from helpers import assert_trees_all_close
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_mr import dlpack


@st.composite
def strided_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes_for_this_mode()))
    rank = draw(st.integers(0, 4))
    sizes = draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    steps = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    offset = draw(st.integers(0, 2))
    full = [max(s * p, 1) for s, p in zip(sizes, steps, strict=True)]
    storage = values((offset + int(np.prod(full)),), dtype)
    tensor = storage[offset:].reshape(full)
    tensor = tensor[tuple(slice(0, s * p, p) for s, p in zip(sizes, steps, strict=True))]
    order = draw(st.permutations(range(rank)))
    tensor = tensor.permute(tuple(order))
    if rank and draw(st.booleans()):
        dim = draw(st.integers(0, rank - 1))
        if tensor.shape[dim] == 1:
            shape = list(tensor.shape)
            shape[dim] = draw(st.integers(1, 3))
            tensor = tensor.expand(shape)
    return tensor


def _compact(tensor: torch.Tensor) -> bool:
    """Independent check: some permutation of the dims is C-contiguous."""
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return tensor.permute(tuple(order)).is_contiguous()


@settings(max_examples=50, deadline=None)
@given(strided_tensors())
def test_zero_copy_iff_compact_and_aligned(tensor: torch.Tensor) -> None:
    shareable = _compact(tensor) and tensor.data_ptr() % 64 == 0
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([tensor])
    assert stats.imports == 1
    assert stats.copies == (0 if shareable else 1)
    assert stats.bytes_copied == (0 if shareable else tensor.numel() * tensor.element_size())
    if shareable and tensor.numel():
        assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    assert_trees_all_close(array, tensor, rtol=0, atol=0, check_dtype=True)
    (back,) = dlpack.export_arrays([array])
    assert back.dtype == tensor.dtype
    assert torch.equal(back, tensor)
