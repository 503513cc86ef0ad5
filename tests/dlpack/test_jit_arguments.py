"""`jit_arguments` (numpy views where jit shares them, DLPack otherwise) and owned exports."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
from dlpack_cases import DTYPES, dtype_params, values

from bridge_mr import dlpack
from bridge_mr.dlpack import _runtime

NUMPY_DTYPES = tuple(d for d in DTYPES if d != torch.bfloat16)


def _shares_memory(argument: object, tensor: torch.Tensor) -> bool:
    if isinstance(argument, np.ndarray):
        return argument.ctypes.data == tensor.data_ptr()
    assert isinstance(argument, jax.Array)
    return argument.unsafe_buffer_pointer() == tensor.data_ptr()


@pytest.mark.parametrize("dtype", dtype_params(), ids=str)
def test_every_dtype_crosses_without_a_copy_and_computes_right(dtype: torch.dtype) -> None:
    tensor = values((3, 4), dtype)
    with dlpack.count_conversions() as stats:
        (argument,) = dlpack.jit_arguments([tensor])
    kind = np.ndarray if dtype in NUMPY_DTYPES else jax.Array
    assert isinstance(argument, kind)
    assert _shares_memory(argument, tensor)
    assert (stats.imports, stats.copies) == (1, 0)
    (back,) = dlpack.export_arrays([jax.jit(lambda a: a[::-1])(argument)])
    assert back.dtype == dtype
    assert torch.equal(back, tensor.flip(0))


def test_jit_places_a_numpy_view_on_the_cpu_without_copying() -> None:
    tensor = torch.arange(16.0)
    (argument,) = dlpack.jit_arguments([tensor])
    array = jax.device_put(argument)  # The placement jit's argument path makes.
    tensor.add_(1)
    np.testing.assert_array_equal(np.asarray(array), np.arange(16.0, dtype=np.float32) + 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        lambda: torch.arange(17.0)[1:],  # start 4 bytes past an aligned allocation
        lambda: torch.complex(torch.ones(3), torch.arange(3.0)).conj(),  # lazy conjugate
        lambda: torch.complex(torch.ones(3), torch.arange(3.0)).conj().imag,  # lazy negative
    ],
    ids=["transposed", "misaligned", "conjugate", "negative"],
)
def test_other_layouts_go_through_the_dlpack_rules(make: object) -> None:
    tensor = make()  # type: ignore[operator]
    (argument,) = dlpack.jit_arguments([tensor])
    (imported,) = dlpack.import_tensors([tensor])
    assert isinstance(argument, jax.Array)
    np.testing.assert_array_equal(np.asarray(argument), np.asarray(imported))
    np.testing.assert_array_equal(np.asarray(argument), tensor.resolve_conj().resolve_neg())


def test_a_tensor_that_requires_grad_becomes_a_detached_view() -> None:
    weights = torch.randn(4, 4, requires_grad=True)
    (argument,) = dlpack.jit_arguments([weights])
    assert isinstance(argument, np.ndarray)
    assert _shares_memory(argument, weights)


def test_mixed_lists_keep_their_order() -> None:
    tensors = [
        torch.ones(2),
        torch.ones(2, dtype=torch.bfloat16),
        torch.arange(3, dtype=torch.int32),
    ]
    arguments = dlpack.jit_arguments(tensors)
    assert [type(a) is np.ndarray for a in arguments] == [True, False, True]
    for argument, tensor in zip(arguments, tensors, strict=True):
        assert _shares_memory(argument, tensor)


def test_a_wide_tensor_with_x64_off_raises_as_import_tensors_does() -> None:
    expected = r"tensors\[1\] has dtype torch.float64; expected a dtype of at most 32 bits"
    with jax.enable_x64(False), pytest.raises(TypeError, match=expected):
        dlpack.jit_arguments([torch.ones(2), torch.ones(2, dtype=torch.float64)])


def test_x64_off_an_int64_tensor_becomes_an_int32_array_in_one_counted_copy() -> None:
    features, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    with jax.enable_x64(False), dlpack.count_conversions() as stats:
        shared, narrowed = dlpack.jit_arguments([features, labels])
        picked = jax.jit(lambda x, y: jax.numpy.take_along_axis(x, y[:, None], axis=1))(
            shared, narrowed
        )
    assert isinstance(shared, np.ndarray)
    assert _shares_memory(shared, features)
    assert isinstance(narrowed, jax.Array)
    assert narrowed.dtype == np.int32
    assert (stats.imports, stats.copies, stats.bytes_copied) == (2, 1, 4 * 4)
    np.testing.assert_array_equal(np.asarray(picked)[:, 0], features[torch.arange(4), labels])


@pytest.mark.parametrize("guarded", [False, True], ids=["numpy_views", "transfer_guard"])
def test_names_name_the_tensors_in_errors(guarded: bool) -> None:
    labels = torch.tensor([1, 2**31])
    guard = jax.transfer_guard_host_to_device("disallow" if guarded else "allow")
    with jax.enable_x64(False), guard:
        with pytest.raises(ValueError, match=re.escape("clients['y']: a torch.int64 tensor")):
            dlpack.jit_arguments([torch.ones(2), labels], names=["server['w']", "clients['y']"])
        with pytest.raises(TypeError, match=re.escape("server['w'] has dtype torch.float64")):
            dlpack.jit_arguments([torch.ones(2, dtype=torch.float64)], names=["server['w']"])
        with pytest.raises(ValueError, match=re.escape("tensors[1]: a torch.int64 tensor")):
            dlpack.jit_arguments([torch.ones(2), labels])


def test_an_unsupported_tensor_raises_naming_it() -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"tensors\[0\]: expected .* layout torch.sparse_coo"):
        dlpack.jit_arguments([sparse])


def test_another_cpu_default_device_still_gets_numpy_views() -> None:
    with jax.default_device(jax.devices("cpu")[1]):
        (argument,) = dlpack.jit_arguments([torch.ones(3)])
    assert isinstance(argument, np.ndarray)


@pytest.mark.parametrize("guarded", [False, True], ids=["bfloat16", "transfer_guard"])
def test_imports_go_to_another_cpu_default_device_as_the_numpy_views_do(guarded: bool) -> None:
    # A tensor that is imported (a dtype numpy lacks, or any under a transfer guard) lands where
    # jit places the numpy views: one device for the program, which a program kept for that
    # device (bridge_mr's disk cache) requires.
    target = jax.devices("cpu")[1]
    tensor = torch.ones(3, dtype=torch.float32 if guarded else torch.bfloat16)
    guard = jax.transfer_guard_host_to_device("disallow" if guarded else "allow")
    with jax.default_device(target), guard:
        (argument,) = dlpack.jit_arguments([tensor])
    assert isinstance(argument, jax.Array)
    assert argument.devices() == {target}
    assert argument.unsafe_buffer_pointer() == tensor.data_ptr()


def test_a_non_cpu_default_backend_gets_jax_arrays_on_the_tensors_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # jit would put a numpy argument on the default device; a CPU tensor must stay on the CPU.
    monkeypatch.setattr(_runtime, "default_platform", lambda: "gpu")
    tensor = torch.ones(3)
    with jax.default_device(None):  # This folder's conftest pins the CPU; unpin it.
        (argument,) = dlpack.jit_arguments([tensor])
    assert isinstance(argument, jax.Array)
    assert argument.devices() == {jax.devices("cpu")[0]}
    assert _shares_memory(argument, tensor)


def test_sole_owner_exports_share_memory_and_stay_independent() -> None:
    outputs = jax.jit(lambda v: (v + 1, v * 2))(jax.numpy.arange(4.0))
    pointers = [o.unsafe_buffer_pointer() for o in outputs]
    with dlpack.count_conversions() as stats:
        first, second = dlpack.export_arrays(list(outputs), sole_owner=True)
    del outputs
    assert (stats.exports, stats.copies) == (2, 0)
    assert [first.data_ptr(), second.data_ptr()] == pointers
    first.zero_()
    np.testing.assert_array_equal(second.numpy(), np.arange(4.0) * 2)
