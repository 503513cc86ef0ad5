"""The dtype table's capability flags are facts of the installed torch and JAX, and its errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from bridge_mr import _dtypes

_DLPACK = [d for d, info in _dtypes.DTYPES.items() if info.dlpack]
_XLA = [d for d, info in _dtypes.DTYPES.items() if info.xla]
_NARROW = [d for d, info in _dtypes.DTYPES.items() if not info.needs_x64]


def _values(dtype: torch.dtype) -> torch.Tensor:
    """Eight values of `dtype`, in a fresh (hence 64-byte aligned) allocation."""
    return torch.arange(8, dtype=torch.int32).to(torch.float32).to(dtype)


@pytest.mark.parametrize(
    "dtype",
    [d if d in _NARROW else pytest.param(d, marks=pytest.mark.x64) for d in _DLPACK],
    ids=str,
)
def test_dlpack_dtypes_cross_zero_copy_both_ways(dtype: torch.dtype) -> None:
    info = _dtypes.DTYPES[dtype]
    tensor = _values(dtype)
    array = jax.dlpack.from_dlpack(tensor)
    assert array.dtype == info.jax
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    result = jax.jit(lambda a: a)(array)
    back = torch.from_dlpack(result)
    assert back.dtype == dtype
    assert back.data_ptr() == result.unsafe_buffer_pointer()
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", _dtypes.DTYPES, ids=str)
def test_numpy_flag_says_whether_tensor_numpy_views_the_jax_dtype(dtype: torch.dtype) -> None:
    info = _dtypes.DTYPES[dtype]
    tensor = _values(dtype)
    if info.numpy:
        view = tensor.numpy()
        assert view.dtype == info.jax
        assert view.ctypes.data == tensor.data_ptr()
    else:
        with pytest.raises(TypeError):
            tensor.numpy()


@pytest.mark.parametrize("dtype", _dtypes.DTYPES, ids=str)
def test_the_jax_dtype_has_the_torch_dtypes_width_and_kind(dtype: torch.dtype) -> None:
    info = _dtypes.DTYPES[dtype]
    assert info.jax.itemsize == dtype.itemsize
    assert info.differentiable == (dtype.is_floating_point and not dtype.is_complex)
    assert info.differentiable == _dtypes.is_differentiable(info.jax)
    assert info.is_complex == dtype.is_complex
    assert info.needs_x64 == (dtype.itemsize == (16 if dtype.is_complex else 8))
    with jax.enable_x64(False):
        assert info.needs_x64 == (jax.dtypes.canonicalize_dtype(info.jax) != info.jax)
    if info.narrow is not None:
        assert info.narrow.itemsize * 2 == dtype.itemsize
    assert _dtypes.torch_dtype(info.jax) is dtype


def test_float8_crosses_on_torch_xla_only() -> None:
    for dtype, jax_type in [
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (torch.float8_e5m2, ml_dtypes.float8_e5m2),
    ]:
        assert _dtypes.jax_dtype(dtype, where="x", xla=True) == np.dtype(jax_type)
        with pytest.raises(TypeError, match=re.escape("(it crosses on torch-xla devices only)")):
            _dtypes.jax_dtype(dtype, where="x")


@pytest.mark.xla
@pytest.mark.parametrize("dtype", [d for d in _XLA if d in _NARROW], ids=str)
def test_xla_dtypes_are_held_by_torch_xla_tensors(dtype: torch.dtype) -> None:
    import torch_xla

    tensor = _values(dtype)
    on_xla = tensor.to(torch_xla.device())
    assert on_xla.dtype == dtype
    assert torch.equal(on_xla.cpu(), tensor)


def test_unsigned_integers_are_supported_everywhere() -> None:
    for dtype in (torch.uint16, torch.uint32):
        info = _dtypes.DTYPES[dtype]
        assert (info.dlpack, info.xla, info.numpy) == (True, True, True)
        assert _dtypes.jax_dtype(dtype, where="x") == info.jax


def test_unsupported_dtypes_name_the_value_and_the_fix() -> None:
    with pytest.raises(TypeError) as info:
        _dtypes.jax_dtype(torch.complex32, where="args[0]['w']")
    message = str(info.value)
    assert message.startswith(
        "args[0]['w']: expected a tensor of a dtype JAX shares with torch, got a torch.complex32 "
        "tensor. Fix: cast it with .to(...) to one of torch.bool, "
    )
    assert "float8" not in message
    with pytest.raises(TypeError, match=r"torch\.float8_e4m3fn, torch\.float8_e5m2"):
        _dtypes.jax_dtype(torch.complex32, where="x", xla=True)


def test_jax_dtypes_torch_lacks_are_refused() -> None:
    for dtype in (jnp.int4, jax.dtypes.float0, ml_dtypes.float8_e4m3b11fnuz):
        with pytest.raises(TypeError, match="expected a JAX value of a dtype torch has"):
            _dtypes.torch_dtype(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_one_x64_message(dtype: torch.dtype) -> None:
    narrow = _dtypes.DTYPES[dtype].narrow
    with jax.enable_x64(False), pytest.raises(TypeError) as info:
        _dtypes.jax_dtype(dtype, where="tensors[3]")
    assert str(info.value) == str(_dtypes.x64_error("tensors[3]", dtype))
    assert str(info.value) == (
        f"tensors[3] has dtype {dtype}; expected a dtype of at most 32 bits while JAX's 64-bit "
        f"mode is off (JAX would compute in {narrow}, and bridge_mr never downcasts silently). "
        f'Fix: enable x64 with jax.config.update("jax_enable_x64", True) before any JAX work, '
        f"or cast the tensor yourself with .to({narrow})."
    )
    with_option = str(_dtypes.x64_error("t", dtype, downcast_option="allow_x64_downcast"))
    assert f", pass allow_x64_downcast=True to convert it to {narrow} (one copy), or" in (
        with_option
    )
    with jax.enable_x64(True):
        assert _dtypes.jax_dtype(dtype, where="tensors[3]") == _dtypes.DTYPES[dtype].jax


@pytest.mark.parametrize(
    ("dtype", "narrow"), [(torch.int64, torch.int32), (torch.uint64, torch.uint32)], ids=str
)
def test_64_bit_integers_narrow_while_x64_is_off_and_only_they(
    dtype: torch.dtype, narrow: torch.dtype
) -> None:
    assert _dtypes.DTYPES[dtype].narrows_when_x64_off
    with jax.enable_x64(False):
        assert _dtypes.narrowed(dtype) is narrow
        assert _dtypes.jax_dtype(dtype, where="x") == _dtypes.DTYPES[narrow].jax
        assert _dtypes.jax_dtype(dtype, where="x", xla=True) == _dtypes.DTYPES[narrow].jax
    with jax.enable_x64(True):
        assert _dtypes.narrowed(dtype) is None
        assert _dtypes.jax_dtype(dtype, where="x") == _dtypes.DTYPES[dtype].jax
    others = [d for d, info in _dtypes.DTYPES.items() if d not in (torch.int64, torch.uint64)]
    assert not any(_dtypes.DTYPES[d].narrows_when_x64_off for d in others)
    with jax.enable_x64(False):
        assert all(_dtypes.narrowed(d) is None for d in others)
    assert {np.dtype(np.int32), np.dtype(np.uint32)} == _dtypes.NARROW_TARGETS


def test_the_narrowing_check_names_the_value_the_range_and_the_fix() -> None:
    _dtypes.check_narrowable("x", torch.int64, -(2**31), 2**31 - 1)
    _dtypes.check_narrowable("x", torch.uint64, 0, 2**32 - 1)
    with pytest.raises(ValueError, match=r"^args\[0\]\['y'\]: ") as info:
        _dtypes.check_narrowable("args[0]['y']", torch.int64, -1, 2**31)
    assert str(info.value) == (
        "args[0]['y']: a torch.int64 tensor crosses to JAX as int32 while JAX's 64-bit mode is "
        "off, so its values must lie in [-2147483648, 2147483647]; it holds 2147483648. Fix: "
        'enable x64 with jax.config.update("jax_enable_x64", True) before any JAX work, or '
        "bring the values into that range (e.g. renumber the ids) before the call."
    )
    # `extremes` reads a uint64 tensor through its int64 view: 2**63 and up come back negative.
    found = _dtypes.extremes(torch.tensor([5, 2**63], dtype=torch.uint64)).tolist()
    assert found == [-(2**63), 5]
    with pytest.raises(ValueError, match=r"it holds 9223372036854775808\. Fix"):
        _dtypes.check_narrowable("x", torch.uint64, *found)
    assert _dtypes.extremes(torch.zeros(0, 3, dtype=torch.int64)).tolist() == [0, 0]
    assert _dtypes.extremes(torch.tensor([[4, -7], [9, 0]]).t()).tolist() == [-7, 9]
