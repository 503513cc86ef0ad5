"""Per-case rules: pytrees, grads, conjugate views, x64, unsupported tensors and their errors."""

from __future__ import annotations

import collections
import gc
import re
import warnings
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dlpack_cases import dtype_params, values
from helpers import assert_trees_all_close

from bridge_mr import dlpack

Pair = collections.namedtuple("Pair", ["first", "second"])


def test_pytrees_keep_structure_and_pass_other_leaves_through() -> None:
    weights = torch.randn(3, 2)
    marker = object()
    numpy_leaf = np.ones(2)
    jax_leaf = jnp.ones(2)
    tree = {
        "pair": Pair(weights, [torch.arange(4, dtype=torch.int32), None]),
        "other": (marker, 3, "name", numpy_leaf, jax_leaf),
    }
    converted = dlpack.to_jax(tree)
    assert jax.tree.structure(converted) == jax.tree.structure(tree)
    assert isinstance(converted["pair"], Pair)
    assert isinstance(converted["pair"].first, jax.Array)
    assert converted["pair"].second[1] is None
    assert converted["other"][0] is marker
    assert converted["other"][3] is numpy_leaf
    assert converted["other"][4] is jax_leaf
    assert_trees_all_close(converted["pair"], tree["pair"], rtol=0, atol=0, check_dtype=True)

    back = dlpack.to_torch(converted)
    assert isinstance(back["pair"].first, torch.Tensor)
    assert isinstance(back["other"][4], torch.Tensor)
    assert back["other"][3] is numpy_leaf
    assert back["pair"].first.data_ptr() == weights.data_ptr()
    untouched = torch.ones(2)
    assert dlpack.to_torch({"t": untouched})["t"] is untouched


def test_single_leaf_trees() -> None:
    tensor = torch.arange(3.0)
    array = dlpack.to_jax(tensor)
    assert isinstance(array, jax.Array)
    assert isinstance(dlpack.to_torch(array), torch.Tensor)
    assert dlpack.to_jax(None) is None
    assert dlpack.to_torch(None) is None


def test_requires_grad_is_detached_without_copy() -> None:
    leaf = torch.randn(4, 3, requires_grad=True)
    nonleaf = leaf * 2
    with dlpack.count_conversions() as stats:
        arrays = dlpack.import_tensors([leaf, nonleaf, leaf.view(12)])
    assert stats.copies == 0
    assert arrays[0].unsafe_buffer_pointer() == leaf.data_ptr()
    assert arrays[1].unsafe_buffer_pointer() == nonleaf.data_ptr()
    assert_trees_all_close(arrays, [leaf, nonleaf, leaf.view(12)], rtol=0, atol=0)


def test_import_does_not_keep_the_autograd_graph_alive() -> None:
    freed = []

    class Saved:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            weakref.finalize(self, freed.append, True)

    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor):
        product = x * w  # its graph node holds two `Saved`
    arrays = dlpack.import_tensors([product, product[::2], product[None].t()])
    del product
    gc.collect()
    assert freed == [True, True]
    assert len(arrays) == 3


def test_stride_zero_cotangent_from_sum_backward_is_copied_once() -> None:
    seen = []
    x = torch.randn(3, 4, requires_grad=True)
    x.register_hook(lambda grad: seen.append(grad))
    x.sum().backward()
    (grad,) = seen
    assert 0 in grad.stride(), "torch no longer hands a stride-0 cotangent; revisit this test"
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([grad])
    assert (stats.copies, stats.bytes_copied) == (1, 12 * 4)
    np.testing.assert_array_equal(np.asarray(array), np.ones((3, 4), np.float32))


def test_non_compact_requires_grad_is_copied_and_detached() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    with dlpack.count_conversions() as stats:
        array = dlpack.to_jax(x[:, ::2])
    assert stats.copies == 1
    assert_trees_all_close(array, x[:, ::2], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", dtype_params([torch.complex64, torch.complex128]), ids=str)
def test_conjugate_and_negative_views_are_resolved_by_one_copy(dtype: torch.dtype) -> None:
    base = values((3, 4), dtype)
    conj = base.conj()
    neg_imag = base.conj().imag
    assert conj.is_conj()
    assert neg_imag.is_neg()
    with dlpack.count_conversions() as stats:
        arrays = dlpack.import_tensors([conj, neg_imag, torch._neg_view(base)])
    assert stats.copies == 3
    np.testing.assert_array_equal(np.asarray(arrays[0]), np.conj(base.numpy()))
    np.testing.assert_array_equal(np.asarray(arrays[1]), -base.numpy().imag)
    np.testing.assert_array_equal(np.asarray(arrays[2]), -base.numpy())


def test_neg_view_of_real_tensor_is_resolved() -> None:
    base = torch.arange(6.0).reshape(2, 3)
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([torch._neg_view(base)])
    assert stats.copies == 1
    np.testing.assert_array_equal(np.asarray(array), -base.numpy())


def test_misaligned_compact_tensor_is_copied_once_into_aligned_memory() -> None:
    base = torch.arange(17, dtype=torch.float32)
    shifted = base[1:]
    assert shifted.data_ptr() % 64 != 0
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([shifted])
    assert (stats.copies, stats.bytes_copied) == (1, 64)
    assert array.unsafe_buffer_pointer() % 64 == 0
    np.testing.assert_array_equal(np.asarray(array), shifted.numpy())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_x64_off_never_downcasts_floats_silently(dtype: torch.dtype) -> None:
    tensor = values((2, 3), dtype)
    with jax.enable_x64(False):
        with pytest.raises(TypeError) as info:
            dlpack.to_jax({"params": [tensor]})
        message = str(info.value)
        assert message.startswith(
            f"tree['params'][0] has dtype {dtype}; expected a dtype of at most 32 bits while "
            "JAX's 64-bit mode is off"
        )
        assert 'jax.config.update("jax_enable_x64", True)' in message
        assert "allow_x64_downcast=True" in message
        with pytest.raises(TypeError, match=re.escape(f"tensors[1] has dtype {dtype}; expected")):
            dlpack.import_tensors([torch.ones(2), tensor])

        with dlpack.count_conversions() as stats:
            array = dlpack.to_jax(tensor, allow_x64_downcast=True)
        narrow = {8: 4, 16: 8}[tensor.element_size()]
        assert array.dtype.itemsize == narrow
        assert (stats.copies, stats.bytes_copied) == (1, 6 * narrow)
        expected = tensor.numpy().astype(np.asarray(array).dtype)
        np.testing.assert_array_equal(np.asarray(array), expected)


_INT64_LAYOUTS: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "contiguous": lambda d: values((3, 4), d),
    "transposed": lambda d: values((4, 3), d).t(),
    "sliced": lambda d: values((3, 8), d)[:, ::2],
    "misaligned": lambda d: values((13,), d)[1:],
    "zero_d": lambda d: values((), d),
    "empty": lambda d: values((0, 3), d),
}


@pytest.mark.parametrize("layout", _INT64_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64], ids=str)
def test_x64_off_64_bit_integers_cross_as_32_bit_in_one_counted_copy(
    dtype: torch.dtype, layout: str
) -> None:
    tensor = _INT64_LAYOUTS[layout](dtype)
    narrow = {torch.int64: np.int32, torch.uint64: np.uint32}[dtype]
    with jax.enable_x64(False), dlpack.count_conversions() as stats:
        converted = dlpack.to_jax({"labels": tensor})
    array = converted["labels"]
    assert array.dtype == narrow
    assert array.shape == tuple(tensor.shape)
    np.testing.assert_array_equal(np.asarray(array), tensor.numpy().astype(narrow))
    assert (stats.imports, stats.copies, stats.bytes_copied) == (1, 1, tensor.numel() * 4)


def test_x64_off_each_64_bit_integer_tensor_is_one_copy_and_the_rest_are_shared() -> None:
    floats = torch.randn(3, 4)
    ids = [
        torch.arange(5),
        torch.arange(6).reshape(2, 3).t(),
        torch.tensor([7], dtype=torch.uint64),
    ]
    with jax.enable_x64(False), dlpack.count_conversions() as stats:
        arrays = dlpack.import_tensors([floats, *ids])
    assert (stats.imports, stats.copies, stats.bytes_copied) == (4, 3, (5 + 6 + 1) * 4)
    assert arrays[0].unsafe_buffer_pointer() == floats.data_ptr()
    assert [a.dtype for a in arrays] == [np.float32, np.int32, np.int32, np.uint32]
    for array, tensor in zip(arrays[1:], ids, strict=True):
        np.testing.assert_array_equal(np.asarray(array), tensor.numpy())


@pytest.mark.parametrize(
    ("dtype", "held", "offending", "bounds"),
    [
        (torch.int64, [0, 2**31], "2147483648", "[-2147483648, 2147483647]"),
        (torch.int64, [-(2**31) - 1, 5], "-2147483649", "[-2147483648, 2147483647]"),
        (torch.int64, [-(2**40), 2**40], "-1099511627776 and 1099511627776", "[-2147483648, "),
        (torch.uint64, [1, 2**32], "4294967296", "[0, 4294967295]"),
        (torch.uint64, [2**64 - 1, 3], "18446744073709551615", "[0, 4294967295]"),
    ],
    ids=["int64_above", "int64_below", "int64_both", "uint64_above", "uint64_top_bit"],
)
def test_x64_off_a_64_bit_integer_out_of_range_names_the_leaf_the_value_and_the_fix(
    dtype: torch.dtype, held: list[int], offending: str, bounds: str
) -> None:
    tensor = torch.tensor(held, dtype=dtype)
    narrow = {torch.int64: "int32", torch.uint64: "uint32"}[dtype]
    start = (
        f"tree['batch']['y']: a {dtype} tensor crosses to JAX as {narrow} while JAX's 64-bit "
        f"mode is off, so its values must lie in {bounds}"
    )
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=f"^{re.escape(start)}") as info:
            dlpack.to_jax({"batch": {"y": tensor}})
        message = str(info.value)
        assert f"it holds {offending}. Fix: " in message
        assert 'jax.config.update("jax_enable_x64", True) before any JAX work' in message
        assert "bring the values into that range" in message
        with pytest.raises(ValueError, match=re.escape("tensors[1]: a ")):
            dlpack.import_tensors([torch.ones(2), tensor])
        # allow_x64_downcast is about floats: integers are checked all the same.
        with pytest.raises(ValueError, match=re.escape(f"it holds {offending}.")):
            dlpack.to_jax(tensor, allow_x64_downcast=True)


def test_x64_off_the_32_bit_range_ends_fit() -> None:
    ends = torch.tensor([-(2**31), 2**31 - 1])
    top = torch.tensor([0, 2**32 - 1], dtype=torch.uint64)
    with jax.enable_x64(False):
        low_high, unsigned = dlpack.import_tensors([ends, top])
    np.testing.assert_array_equal(np.asarray(low_high), [-(2**31), 2**31 - 1])
    np.testing.assert_array_equal(np.asarray(unsigned), np.array([0, 2**32 - 1], np.uint32))


@pytest.mark.x64
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64], ids=str)
def test_x64_on_64_bit_integers_cross_as_they_are_without_a_copy(dtype: torch.dtype) -> None:
    tensor = torch.tensor([3, 2**40, 2**62], dtype=dtype)
    with dlpack.count_conversions() as stats:
        array = dlpack.to_jax(tensor)
    assert array.dtype == {torch.int64: np.int64, torch.uint64: np.uint64}[dtype]
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    assert stats.copies == 0
    np.testing.assert_array_equal(np.asarray(array), tensor.numpy())


def _quietly(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`make`, ignoring torch's "prototype"/"beta"/"experimental" UserWarnings."""

    def quiet() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return make()

    return quiet


UNSUPPORTED = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "layout torch.sparse_coo", ".to_dense()"),
    "sparse_csr": (
        _quietly(lambda: torch.eye(3).to_sparse_csr()),
        "layout torch.sparse_csr",
        ".to_dense()",
    ),
    "quantized": (
        _quietly(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)),
        "quantized torch.qint8",
        ".dequantize()",
    ),
    "nested": (
        _quietly(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
        "nested tensor",
        ".to_padded_tensor(0)",
    ),
    "meta": (lambda: torch.ones(3, device="meta"), "meta tensor", "torch.empty_like"),
}

#: Tensors of dtypes the DLPack path refuses: the message of `bridge_mr._dtypes`, every layer's.
UNSUPPORTED_DTYPES = {
    "complex32": (_quietly(lambda: torch.ones(3, dtype=torch.complex32)), ""),
    "float8": (
        lambda: torch.ones(3).to(torch.float8_e4m3fn),
        " (it crosses on torch-xla devices only)",
    ),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_tensors_name_the_leaf(name: str) -> None:
    make, got, fix = UNSUPPORTED[name]
    tree = {"model": {"layers": [torch.ones(2), make()]}}
    with pytest.raises(TypeError) as info:
        dlpack.to_jax(tree)
    message = str(info.value)
    assert message.startswith("tree['model']['layers'][1]: expected a dense (strided)")
    assert got in message
    assert fix in message.split("Fix:")[1]
    with pytest.raises(TypeError, match=re.escape("tensors[0]: expected")):
        dlpack.import_tensors([make()])


@pytest.mark.parametrize("name", UNSUPPORTED_DTYPES)
def test_unsupported_dtypes_name_the_leaf_and_the_dtypes_to_cast_to(name: str) -> None:
    make, note = UNSUPPORTED_DTYPES[name]
    tensor = make()
    with pytest.raises(TypeError) as info:
        dlpack.to_jax({"model": {"layers": [torch.ones(2), tensor]}})
    message = str(info.value)
    assert message.startswith(
        f"tree['model']['layers'][1]: expected a tensor of a dtype JAX shares with torch, got a "
        f"{tensor.dtype} tensor{note}. Fix: cast it with .to(...) to one of torch.bool, "
    )
    assert "torch.float32" in message.split("Fix:")[1]
    with pytest.raises(TypeError, match=re.escape("tensors[0]: expected a tensor of a dtype")):
        dlpack.import_tensors([tensor])


def test_import_tensors_rejects_non_tensors() -> None:
    expected = re.escape("tensors[1]: expected a torch.Tensor, got numpy")
    with pytest.raises(TypeError, match=expected):
        dlpack.import_tensors([torch.ones(1), np.ones(1)])


def test_to_torch_errors_name_the_leaf() -> None:
    with pytest.raises(TypeError, match=re.escape("tree['k']: expected a concrete jax.Array")):
        jax.jit(lambda v: dlpack.to_torch({"k": v}))(jnp.ones(2))

    donated = jnp.ones(3) + 1
    jax.jit(lambda v: v * 2, donate_argnums=0)(donated)
    with pytest.raises(TypeError, match=re.escape("tree[0]: expected a live jax.Array")):
        dlpack.to_torch([donated])

    with pytest.raises(TypeError, match=re.escape("arrays[0]: expected a JAX array of a dtype")):
        dlpack.export_arrays([jnp.zeros(2, jnp.int4)])

    with pytest.raises(TypeError, match=re.escape("arrays[1]: expected a jax.Array, got torch")):
        dlpack.export_arrays([jnp.zeros(2), torch.zeros(2)])


def test_count_conversions_nests_and_stops_counting_on_exit() -> None:
    with dlpack.count_conversions() as outer:
        dlpack.to_jax(torch.ones(2))
        with dlpack.count_conversions() as inner:
            dlpack.to_torch(dlpack.to_jax(torch.ones(4)[::2]))
    dlpack.to_jax(torch.ones(4)[::2])
    assert dataclasses_tuple(outer) == (2, 1, 1, 8)
    assert dataclasses_tuple(inner) == (1, 1, 1, 8)


def dataclasses_tuple(stats: dlpack.ConversionStats) -> tuple[int, int, int, int]:
    return (stats.imports, stats.exports, stats.copies, stats.bytes_copied)


def _jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.mark.skipif(_jax_has_gpu(), reason="JAX has a GPU backend here")
def test_missing_jax_gpu_backend_error_says_how_to_install() -> None:
    from bridge_mr.dlpack import _runtime

    with pytest.raises(RuntimeError, match=re.escape("needs a JAX GPU backend")) as info:
        _runtime.jax_device("cuda", 0)
    assert 'pip install -U "jax[cuda' in str(info.value)
    assert ".cpu()" in str(info.value)


def test_backend_refusing_permuted_layouts_gets_one_counted_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bridge_mr.dlpack import _import, _runtime

    to_capsule = _runtime.tensor_to_capsule
    refused = []

    def row_major_only(tensor: torch.Tensor) -> object:
        if not tensor.is_contiguous():
            refused.append(tensor.shape)
            raise RuntimeError("UNIMPLEMENTED: only row-major DLPack tensors")
        return to_capsule(tensor)

    monkeypatch.setattr(_runtime, "tensor_to_capsule", row_major_only)
    monkeypatch.setattr(_import, "_PERMUTED_OK", {})
    transposed = torch.arange(12.0).reshape(3, 4).t()
    refusals = []
    for _ in range(2):
        with dlpack.count_conversions() as stats:
            (array,) = dlpack.import_tensors([transposed])
        assert (stats.copies, stats.bytes_copied) == (1, 48)
        np.testing.assert_array_equal(np.asarray(array), transposed.numpy())
        refusals.append(len(refused))
    assert refusals == [1, 1]  # one probe, then the verdict is remembered
    assert _import._PERMUTED_OK == {"cpu": False}


def test_computations_on_a_shared_transposed_tensor_are_right() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    (array,) = dlpack.import_tensors([base.t()])
    assert array.unsafe_buffer_pointer() == base.data_ptr()
    result = jax.jit(lambda v: (v @ jnp.arange(3.0, dtype=v.dtype), v.sum(0), v[1:, ::2] * 2))(
        array
    )
    expected = base.t().numpy()
    weights = np.arange(3.0, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(result[0]), expected @ weights)
    np.testing.assert_array_equal(np.asarray(result[1]), expected.sum(0))
    np.testing.assert_array_equal(np.asarray(result[2]), expected[1:, ::2] * 2)
