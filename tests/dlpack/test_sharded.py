"""Multi-device JAX arrays on the 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr import dlpack


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices("cpu")
    )


def test_fully_replicated_exports_one_replica_without_copy() -> None:
    mesh = _mesh((8,), ("clients",))
    array = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P()))
    assert len(array.sharding.device_set) == 8
    with dlpack.count_conversions() as stats:
        (tensor,) = dlpack.export_arrays([array])
    assert (stats.exports, stats.copies) == (1, 0)
    first = min(array.addressable_shards, key=lambda shard: shard.device.id)
    assert tensor.data_ptr() == first.data.unsafe_buffer_pointer()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(16.0).reshape(4, 4))


@pytest.mark.parametrize(
    ("mesh_shape", "spec"),
    [((8,), P("a")), ((4, 2), P("a")), ((4, 2), P("b", "a")), ((8,), P(None, "a"))],
    ids=["sharded", "partly_replicated", "2d", "second_dim"],
)
def test_sharded_is_gathered_with_one_counted_copy(mesh_shape: tuple[int, ...], spec: P) -> None:
    mesh = _mesh(mesh_shape, ("a", "b")[: len(mesh_shape)])
    expected = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    array = jax.device_put(expected, NamedSharding(mesh, spec))
    with dlpack.count_conversions() as stats:
        (tensor,) = dlpack.export_arrays([array])
    assert (stats.exports, stats.copies, stats.bytes_copied) == (1, 1, expected.nbytes)
    assert tensor.device.type == "cpu"
    np.testing.assert_array_equal(tensor.numpy(), expected)
    np.testing.assert_array_equal(np.asarray(array), expected)


def test_single_device_named_sharding_is_zero_copy() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[3:4]), ("a",))
    array = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("a")))
    with dlpack.count_conversions() as stats:
        (tensor,) = dlpack.export_arrays([array])
    assert stats.copies == 0
    assert tensor.data_ptr() == array.unsafe_buffer_pointer()


def test_sharded_jit_output_round_trip() -> None:
    mesh = _mesh((8,), ("clients",))
    sharding = NamedSharding(mesh, P("clients"))
    out = jax.jit(lambda v: v * 3, out_shardings=sharding)(jnp.arange(8.0))
    tensors = dlpack.to_torch({"out": out, "sum": jnp.sum(out)})
    np.testing.assert_array_equal(tensors["out"].numpy(), np.arange(8.0) * 3)
    assert tensors["sum"].item() == 84.0
