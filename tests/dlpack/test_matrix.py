"""dtype x layout x direction: zero copy exactly where the layout allows, values always equal."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from dlpack_cases import LAYOUTS, Layout, dtype_params
from helpers import assert_trees_all_close

from bridge_mr import dlpack


def _jax_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _assert_same(array: jax.Array, tensor: torch.Tensor) -> None:
    assert array.shape == tuple(tensor.shape)
    assert_trees_all_close(array, tensor, rtol=0, atol=0, check_dtype=True)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", dtype_params(), ids=_jax_dtype_name)
def test_import(dtype: torch.dtype, layout: Layout) -> None:
    tensor = layout.make(dtype)
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([tensor])
    assert array.dtype == np.dtype(_jax_dtype_name(dtype))
    _assert_same(array, tensor)
    assert stats.imports == 1
    if layout.zero_copy:
        assert (stats.copies, stats.bytes_copied) == (0, 0)
        if tensor.numel():
            assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    else:
        assert stats.copies == 1
        assert stats.bytes_copied == tensor.numel() * tensor.element_size()
        assert array.unsafe_buffer_pointer() != tensor.data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", dtype_params(), ids=_jax_dtype_name)
def test_export_round_trip(dtype: torch.dtype, layout: Layout) -> None:
    tensor = layout.make(dtype)
    (array,) = dlpack.import_tensors([tensor])
    with dlpack.count_conversions() as stats:
        (back,) = dlpack.export_arrays([array])
    assert back.dtype == dtype
    assert torch.equal(back, tensor)
    assert (stats.exports, stats.copies) == (1, 0)
    if tensor.numel():
        assert back.data_ptr() == array.unsafe_buffer_pointer()


@pytest.mark.parametrize("shape", [(3, 4), (), (0, 3)], ids=["matrix", "zero_d", "empty"])
@pytest.mark.parametrize("dtype", dtype_params(), ids=_jax_dtype_name)
def test_export_jit_output(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    expected = np.asarray(dlpack.to_jax(torch.zeros(shape, dtype=dtype)))
    expected = expected if dtype == torch.bool else expected + expected.dtype.type(3)
    array = jax.jit(lambda: jax.numpy.asarray(expected))()
    with dlpack.count_conversions() as stats:
        (tensor,) = dlpack.export_arrays([array])
    assert tensor.dtype == dtype
    assert tensor.device.type == "cpu"
    _assert_same(array, tensor)
    assert (stats.exports, stats.copies) == (1, 0)
    if tensor.numel():
        assert tensor.data_ptr() == array.unsafe_buffer_pointer()
