"""JAX arrays -> torch tensors.

A single-device array, or one replica of a fully replicated array, becomes a torch tensor that
shares its memory: no copy. A sharded array is first gathered onto one device: one counted copy.
CPU arrays become CPU tensors; arrays on the JAX GPU with local id i become `cuda:i` tensors,
ordered after the array's producer on torch's current stream.

Aliasing: the tensor shares the array's buffer and keeps it alive, so deleting the array is
safe. JAX assumes its arrays never change; writing to the tensor in place also changes the
array (and any JAX view of a torch tensor it came from). The torch frontend exports only fresh
outputs of a jitted computation, which alias no input, so the tensors it hands to users are
theirs to mutate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import torch

from bridge_mr._compat import jax as _jax_compat

from . import _runtime
from ._stats import ACTIVE, record

_GPU_PLATFORMS = ("gpu", "cuda")

#: What the fast path of `_export_all` expects from an array it cannot export as it is, which
#: `_export_one` then names: RuntimeError (jaxlib's `JaxRuntimeError` for a deleted or donated
#: buffer or a dtype without a DLPack equivalent; torch's refusal of a capsule) and BufferError
#: (DLPack's refusal to export a buffer). Any other exception is a bug, and propagates.
_NOT_AS_IS = (RuntimeError, BufferError)
_UNKNOWN = -1  # A device whose torch stream `_export_one` has not looked up yet.


def export_arrays(arrays: Sequence[jax.Array], *, sole_owner: bool = False) -> list[torch.Tensor]:
    """Converts JAX arrays to torch tensors, sharing memory where possible.

    The flat-list entry point of `to_torch`, meant for fresh outputs of a jitted function; the
    rules are those of `to_torch`. `sole_owner=True` promises that no one will call `.delete()`
    on these array objects (the caller holds the only references, as with the fresh outputs of
    a jitted call it drops after exporting them); a single-device array is then exported
    without taking a new handle on its buffer first (less work per array). Deleting such an
    array while its tensor lives aborts the process (a jaxlib CHECK), so never pass arrays
    that user code can reach.

    Args:
      arrays: the JAX arrays.
      sole_owner: promise that nobody calls `.delete()` on these array objects (see above).

    Returns:
      One torch tensor per array.

    Raises:
      TypeError: an element is not an exportable JAX array (the message names `arrays[i]`).

    Example:
      >>> bridge_mr.dlpack.export_arrays([jnp.arange(3.0), jnp.ones((2, 2), jnp.int32)])
      [tensor([0., 1., 2.]), tensor([[1, 1], [1, 1]], dtype=torch.int32)]
    """
    return _export_all(arrays, _positional_name, fresh=not sole_owner)


def to_torch(tree: Any) -> Any:
    """Converts every JAX array in a pytree to a torch tensor; other leaves pass through.

    Each array becomes a tensor of the same shape and dtype: CPU arrays on the CPU, arrays on
    the JAX GPU with local id i on `cuda:i`. Single-device and fully replicated arrays are
    shared without a copy (a replicated array is read from one replica: the one on torch's
    current CUDA device if it has one, else the first); a sharded array is gathered onto one
    device with one counted copy (`count_conversions`). The call returns once the array's
    producer has finished (CPU) or has been ordered before torch's current stream (CUDA).

    Args:
      tree: a pytree of JAX arrays and other leaves.

    Returns:
      `tree` with each JAX array replaced by its torch tensor.

    Raises:
      TypeError: a leaf cannot be exported (a tracer, a deleted or donated array, an array not
        fully addressable by this process, a TPU array, or a dtype torch lacks); the message
        names the leaf's path.

    Example:
      >>> bridge_mr.dlpack.to_torch({"step": 3, "w": jnp.arange(3.0)})
      {'step': 3, 'w': tensor([0., 1., 2.])}
      >>> mesh = jax.make_mesh((8,), ("clients",))
      >>> sharded = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("clients")))
      >>> with bridge_mr.dlpack.count_conversions() as stats:
      ...     gathered = bridge_mr.dlpack.to_torch(sharded)  # on 8 devices: gathered, one copy
      >>> gathered, stats.copies
      (tensor([0., 1., 2., 3., 4., 5., 6., 7.]), 1)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def name_of(k: int) -> str:
        path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][positions[k]]
        return "tree" + jax.tree_util.keystr(path)

    tensors = _export_all([leaves[i] for i in positions], name_of, fresh=True)
    for i, tensor in zip(positions, tensors, strict=True):
        leaves[i] = tensor
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _positional_name(index: int) -> str:
    return f"arrays[{index}]"


def _export_all(
    arrays: Sequence[Any], name_of: Callable[[int], str], *, fresh: bool
) -> list[torch.Tensor]:
    """Each array as a tensor; `fresh`: the capsule holds a new handle on the buffer, not the
    array (which its owner may then delete)."""
    out: list[torch.Tensor] = []
    append = out.append
    cuda_streams: dict[Any, int] = {}
    # C functions (no Python frame per array): this runs for every output of every call.
    to_capsule = _runtime.array_to_capsule
    from_capsule = _runtime.tensor_from_capsule
    fresh_handle = _runtime.fresh_handle
    devices = _jax_compat.single_devices(arrays)
    for index, (array, device) in enumerate(zip(arrays, devices, strict=True)):
        # Fast path for single-device CPU and GPU arrays; anything else (including a failure
        # here that `_NOT_AS_IS` expects) is redone by `_export_one`, which gathers or explains.
        if device is not None:
            stream = None if device.platform == "cpu" else cuda_streams.get(device, _UNKNOWN)
            if stream is not _UNKNOWN:
                try:
                    append(
                        from_capsule(to_capsule(fresh_handle(array) if fresh else array, stream))
                    )
                    continue
                except _NOT_AS_IS:
                    pass
        append(_export_one(array, name_of, index, cuda_streams))
    if ACTIVE:
        record(exports=len(out))
    return out


def _export_one(
    array: Any, name_of: Callable[[int], str], index: int, cuda_streams: dict[Any, int]
) -> torch.Tensor:
    single = _single_device_array(array, name_of, index)
    device = next(iter(single.devices()))
    if device.platform == "cpu":
        stream = None
    elif device.platform in _GPU_PLATFORMS:
        stream = cuda_streams.get(device)
        if stream is None:
            stream = _runtime.torch_stream_pointer(device.local_hardware_id)
            cuda_streams[device] = stream
    else:
        raise TypeError(
            f"{name_of(index)}: expected a JAX array on CPU or GPU, got one on {device}, which "
            f"DLPack cannot share with torch. Fix: fetch it with jax.device_get and build the "
            f"tensor with torch.from_numpy, or use the torch-xla frontend on TPU."
        )
    try:
        return _runtime.array_to_tensor(single, stream)
    except Exception as err:
        raise TypeError(
            f"{name_of(index)}: expected a JAX array of a dtype torch supports, got "
            f"{array.dtype} (torch refused it: {err}). Fix: cast it in JAX first, e.g. "
            f"x.astype(jnp.float32)."
        ) from err


def _single_device_array(array: Any, name_of: Callable[[int], str], index: int) -> jax.Array:
    """`array` if it lives on one device, else one replica of it, else a gathered copy."""
    if isinstance(array, jax.core.Tracer):
        raise TypeError(
            f"{name_of(index)}: expected a concrete jax.Array, got a tracer ({array}). "
            f"Fix: convert results after the jitted/transformed function returns, not inside it."
        )
    if not isinstance(array, jax.Array):
        raise TypeError(
            f"{name_of(index)}: expected a jax.Array, got {type(array).__module__}."
            f"{type(array).__qualname__}. Fix: pass JAX arrays only (to_torch passes other "
            f"leaves through unchanged)."
        )
    if array.is_deleted():
        raise TypeError(
            f"{name_of(index)}: expected a live jax.Array, got one that was deleted or donated "
            f"to a jitted function. Fix: export it before donating it, or export the result."
        )
    if not array.is_fully_addressable:
        raise TypeError(
            f"{name_of(index)}: expected an array this process can read entirely, got one "
            f"sharded across processes ({array.sharding}). Fix: gather it first, e.g. with "
            f"jax.experimental.multihost_utils.process_allgather."
        )
    sharding = array.sharding
    if len(sharding.device_set) == 1:
        return array
    target = _preferred_device(sharding.addressable_devices)
    if sharding.is_fully_replicated:
        for shard in array.addressable_shards:
            if shard.device == target:
                return shard.data
    gathered = jax.device_put(array, target)
    if ACTIVE:
        record(copies=1, bytes_copied=gathered.nbytes)
    return gathered


def _preferred_device(devices: Any) -> Any:
    """torch's current CUDA device if it is among `devices`, else the one with the lowest id."""
    ordered = sorted(devices, key=lambda d: d.id)
    if ordered[0].platform in _GPU_PLATFORMS and torch.cuda.is_available():
        current = torch.cuda.current_device()
        for device in ordered:
            if device.local_hardware_id == current:
                return device
    return ordered[0]
