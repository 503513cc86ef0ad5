"""What shares memory with what, and what stays valid when either side changes or goes away."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr import dlpack


def _scribble_over_freed_memory() -> None:
    for _ in range(8):
        torch.full((4096,), -7.0)


def test_zero_copy_import_is_a_view_of_the_tensor() -> None:
    tensor = torch.arange(6.0)
    (array,) = dlpack.import_tensors([tensor])
    tensor.mul_(10)
    np.testing.assert_array_equal(np.asarray(array), np.arange(6.0, dtype=np.float32) * 10)


def test_jit_outputs_alias_no_input_even_for_identity() -> None:
    tensor = torch.arange(6.0)
    (array,) = dlpack.import_tensors([tensor])
    outputs = dlpack.export_arrays(list(jax.jit(lambda v: (v, v * 2))(array)))
    assert all(out.data_ptr() != tensor.data_ptr() for out in outputs)
    outputs[0].add_(100)
    outputs[1].zero_()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(6.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(array), np.arange(6.0, dtype=np.float32))


def test_in_place_write_to_an_export_leaves_other_outputs_alone() -> None:
    x = jnp.arange(4.0)
    a, b = jax.jit(lambda v: (v + 1, v + 2))(x)
    ta, tb = dlpack.export_arrays([a, b])
    ta.mul_(0)
    np.testing.assert_array_equal(tb.numpy(), np.arange(4.0) + 2)
    np.testing.assert_array_equal(np.asarray(x), np.arange(4.0))
    np.testing.assert_array_equal(np.asarray(a), np.zeros(4))  # the export shares `a`


def test_deleting_the_tensor_keeps_the_imported_array_valid() -> None:
    tensor = torch.arange(4096.0)
    (array,) = dlpack.import_tensors([tensor])
    del tensor
    gc.collect()
    _scribble_over_freed_memory()
    np.testing.assert_array_equal(np.asarray(array), np.arange(4096.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp.sum)(array)), np.float32(4095 * 2048))


def test_deleting_the_array_keeps_the_exported_tensor_valid() -> None:
    array = jax.jit(lambda: jnp.arange(4096.0))()
    (tensor,) = dlpack.export_arrays([array])
    array.delete()
    del array
    gc.collect()
    _scribble_over_freed_memory()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(4096.0))


def test_deleting_the_imported_array_keeps_the_tensor_valid() -> None:
    tensor = torch.arange(8.0)
    (array,) = dlpack.import_tensors([tensor])
    array.delete()
    del array
    gc.collect()
    tensor.add_(1)
    np.testing.assert_array_equal(tensor.numpy(), np.arange(8.0, dtype=np.float32) + 1)


def test_deleting_a_round_tripped_array_keeps_both_tensors_valid() -> None:
    tensor = torch.arange(8.0)
    (array,) = dlpack.import_tensors([tensor])
    (back,) = dlpack.export_arrays([array])
    array.delete()
    del array, tensor
    gc.collect()
    _scribble_over_freed_memory()
    np.testing.assert_array_equal(back.numpy(), np.arange(8.0, dtype=np.float32))


def test_donating_an_imported_array_never_writes_into_the_tensor() -> None:
    tensor = torch.arange(8.0)
    (array,) = dlpack.import_tensors([tensor])
    result = jax.jit(lambda v: v * 2, donate_argnums=0)(array)
    np.testing.assert_array_equal(np.asarray(result), np.arange(8.0) * 2)
    assert result.unsafe_buffer_pointer() != tensor.data_ptr()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(8.0))


def test_donating_an_exported_array_never_reuses_the_tensor_memory() -> None:
    array = jax.jit(lambda: jnp.arange(8.0))()
    (tensor,) = dlpack.export_arrays([array])
    result = jax.jit(lambda v: v * 2, donate_argnums=0)(array)
    np.testing.assert_array_equal(np.asarray(result), np.arange(8.0) * 2)
    assert result.unsafe_buffer_pointer() != tensor.data_ptr()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(8.0))


def test_export_of_an_in_flight_result_sees_the_final_values() -> None:
    matrix = jnp.full((700, 700), 1e-3, jnp.float32)
    slow = jax.jit(lambda m: jnp.tanh(m @ m @ m @ m @ m) + 1)
    expected = np.asarray(slow(matrix))
    for _ in range(3):
        (tensor,) = dlpack.export_arrays([slow(matrix)])
        np.testing.assert_array_equal(tensor.numpy(), expected)


def test_a_permuted_tensors_array_computes_right_and_its_moved_copy_as_documented() -> None:
    """A permuted tensor shares its memory as an array in its layout, which computes right; on
    jaxlib 0.10.2 a `jax.device_put` copy of it (`may_alias=False`) computed as if row-major,
    as `to_jax`'s docstring warns. Strict: a jaxlib that fixes it fails this test, so that the
    warning goes."""
    tensor = torch.arange(2 * 4 * 5 * 3, dtype=torch.float32).reshape(2, 4, 5, 3)
    seen = tensor.permute(0, 3, 1, 2)  # NHWC memory, NCHW seen
    array = dlpack.to_jax(seen)
    want = seen.numpy() * 2
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2)(array)), want)
    moved = jax.device_put(array, may_alias=False)
    wrong = not np.array_equal(np.asarray(jax.jit(lambda a: a * 2)(moved)), want)
    assert wrong, "jaxlib now computes right on the moved copy: drop the to_jax warning"
