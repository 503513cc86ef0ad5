"""CUDA tensors <-> JAX GPU arrays: zero copy, device index, and stream ordering.

The `cuda` marker skips them unless torch sees a CUDA device and JAX has a GPU backend
(tests/conftest.py); the two-GPU tests also skip with fewer than two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dlpack_cases import dtype_params, values
from helpers import assert_trees_all_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr import dlpack


def _jax_gpus() -> list[jax.Device]:
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


_GPUS = _jax_gpus() if torch.cuda.is_available() else []
pytestmark = pytest.mark.cuda  # Skipped without a GPU (tests/conftest.py).


def _gpu(index: int) -> jax.Device:
    return next(d for d in _GPUS if d.local_hardware_id == index)


CUDA_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.bool,
    torch.complex64,
)


@pytest.mark.parametrize("dtype", dtype_params(CUDA_DTYPES), ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "offset"])
def test_import_cuda(dtype: torch.dtype, layout: str) -> None:
    base = values((8, 16), dtype).cuda()
    tensor = {
        "contiguous": base,
        "transposed": base.t(),
        "sliced": base[:, ::2],
        "offset": base.flatten()[1:65].reshape(8, 8),
    }[layout]
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([tensor])
    assert array.devices() == {_gpu(0)}
    assert array.dtype == np.dtype(str(dtype).removeprefix("torch."))
    zero_copy = layout in ("contiguous", "transposed")
    assert stats.copies == (0 if zero_copy else 1)
    assert (array.unsafe_buffer_pointer() == tensor.data_ptr()) == zero_copy
    assert_trees_all_close(array, tensor, rtol=0, atol=0, check_dtype=True)


@pytest.mark.parametrize("dtype", dtype_params(CUDA_DTYPES), ids=str)
def test_export_cuda(dtype: torch.dtype) -> None:
    source = values((8, 16), dtype)
    array = jax.jit(lambda v: v)(jax.device_put(dlpack.to_jax(source), _gpu(0)))
    with dlpack.count_conversions() as stats:
        (tensor,) = dlpack.export_arrays([array])
    assert (stats.exports, stats.copies) == (1, 0)
    assert tensor.device == torch.device("cuda", 0)
    assert tensor.dtype == dtype
    assert tensor.data_ptr() == array.unsafe_buffer_pointer()
    assert torch.equal(tensor.cpu(), source)


def test_x64_off_an_int64_cuda_tensor_narrows_on_its_gpu_in_one_checked_copy() -> None:
    tensor = torch.arange(-8, 8, device="cuda").reshape(4, 4)
    with jax.enable_x64(False):
        with dlpack.count_conversions() as stats:
            (array,) = dlpack.import_tensors([tensor[:, ::2]])
        assert array.devices() == {_gpu(0)}
        assert array.dtype == np.int32
        assert (stats.copies, stats.bytes_copied) == (1, 8 * 4)
        np.testing.assert_array_equal(np.asarray(array), tensor[:, ::2].cpu().numpy())
        with pytest.raises(
            ValueError, match=r"^tree\['ids'\]: a torch.int64 .* holds 4294967296\."
        ):
            dlpack.to_jax({"ids": torch.tensor([0, 2**32], device="cuda")})


def test_import_waits_for_pending_torch_work_on_a_side_stream() -> None:
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(side):
            tensor = torch.zeros(1 << 22, device="cuda")
            for _ in range(200):
                tensor.add_(1)
            (array,) = dlpack.import_tensors([tensor])
            total = jax.jit(jnp.sum)(array)
        assert float(total) == 200.0 * (1 << 22)
        side.synchronize()


def test_export_orders_torch_after_the_jax_producer() -> None:
    matrix = jax.device_put(jnp.full((2048, 2048), 1e-4, jnp.float32), _gpu(0))
    slow = jax.jit(lambda m: jnp.tanh(m @ m @ m @ m @ m @ m) + 1)
    expected = torch.tensor(np.asarray(slow(matrix)))
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(side):
            (tensor,) = dlpack.export_arrays([slow(matrix)])
            doubled = tensor * 2
        side.synchronize()
        torch.testing.assert_close(doubled.cpu(), expected * 2)


def test_round_trip_and_pytrees_on_cuda() -> None:
    tree = {"w": torch.randn(4, 4, device="cuda"), "b": [torch.arange(3, device="cuda"), None]}
    back = dlpack.to_torch(dlpack.to_jax(tree))
    assert back["w"].data_ptr() == tree["w"].data_ptr()
    assert torch.equal(back["b"][0], tree["b"][0])


@pytest.mark.skipif(len(_GPUS) < 2, reason="needs two GPUs")
def test_cuda_index_maps_to_the_same_jax_gpu() -> None:
    tensor = torch.ones(4, device="cuda:1")
    (array,) = dlpack.import_tensors([tensor])
    assert array.devices() == {_gpu(1)}
    (back,) = dlpack.export_arrays([array])
    assert back.device == torch.device("cuda", 1)


@pytest.mark.skipif(len(_GPUS) < 2, reason="needs two GPUs")
def test_replicated_and_sharded_gpu_arrays() -> None:
    mesh = jax.sharding.Mesh(np.array(_GPUS[:2]), ("a",))
    replicated = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P()))
    sharded = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("a")))
    with dlpack.count_conversions() as stats:
        rep, shd = dlpack.export_arrays([replicated, sharded])
    assert stats.copies == 1
    assert rep.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(rep.cpu(), torch.arange(8.0))
    assert torch.equal(shd.cpu(), torch.arange(8.0))
