"""The JAX and torch entry points the converters call, plus device and stream lookup.

The conversions call the jaxlib and torch functions that `jax.dlpack.from_dlpack`,
`jax.Array.__dlpack__` and `torch.from_dlpack` themselves call, reached through
`bridge_mr._compat` (which requires jaxlib 0.10.2 or newer). Nothing here initialises a JAX
backend at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.backend
import torch
import torch.utils.dlpack

from bridge_mr import _caches
from bridge_mr._compat import jax as _jax_compat
from bridge_mr._compat import jaxlib as _jaxlib
from bridge_mr._compat import torch as _torch_compat

DL_CPU = _jaxlib.DL_CPU
DL_CUDA = _jaxlib.DL_CUDA

#: Wraps a DLPack capsule as a jax.Array on a device, sharing its memory:
#: `(capsule, device, stream, dl_device_type) -> jax.Array`.
capsule_to_array: Callable[[Any, Any, int | None, int], jax.Array] = _jaxlib.capsule_to_array

#: A DLPack capsule sharing a torch tensor's memory.
tensor_to_capsule: Callable[[torch.Tensor], Any] = (
    # Documented, but missing from torch.utils.dlpack.__all__ (torch 2.13).
    torch.utils.dlpack.to_dlpack  # pyright: ignore[reportPrivateImportUsage]
)

#: A torch tensor sharing a DLPack capsule's memory.
tensor_from_capsule: Callable[[Any], torch.Tensor] = _torch_compat.tensor_from_capsule

#: A DLPack capsule sharing a single-device jax.Array's buffer: `(array, stream)`.
array_to_capsule: Callable[[Any, int | None], Any] = _jaxlib.array_to_capsule
#: A new handle on a single-device jax.Array's buffer (so that deleting the array stays safe).
fresh_handle: Callable[[jax.Array], jax.Array] = _jax_compat.fresh_handle

x64_enabled = _jax_compat.x64_enabled
default_device = _jax_compat.default_device
transfer_guard_host_to_device = _jax_compat.transfer_guard_host_to_device


def array_to_tensor(array: jax.Array, stream: int | None) -> torch.Tensor:
    """Wraps a single-device jax.Array as a torch tensor without copying.

    The capsule holds a fresh handle on the buffer, not `array` itself, so that a later
    `array.delete()` stays safe. `stream` is the torch CUDA stream that must wait for the
    array's producer (None on CPU).
    """
    return tensor_from_capsule(array_to_capsule(fresh_handle(array), stream))


# Devices and the default platform, looked up once per set of backends: `clear_backends()`
# replaces the backends dict the cache was filled from.
_cache: dict[Any, Any] = _caches.register("dlpack devices", {})
_cache_generation: object = None  # The backends `_cache` was filled from.


def _current_cache() -> dict[Any, Any]:
    global _cache_generation
    generation = _jax_compat.backends_generation()
    if generation is not _cache_generation:
        _cache.clear()
        _cache_generation = generation
    return _cache


def jax_device(platform: str, local_id: int) -> Any:
    """The JAX device of `platform` ("cpu" or "cuda") with the given local hardware id.

    Raises:
      RuntimeError: JAX has no backend for `platform`, or no such device.
    """
    cache = _current_cache()
    key = (platform, local_id)
    device = cache.get(key)
    if device is None:
        device = cache[key] = _lookup_device(platform, local_id)
    return device


def default_platform() -> str:
    """The platform of JAX's default backend ("cpu", "gpu", ...)."""
    if _jax_compat.backends_generation() is _cache_generation:  # `_current_cache`, inline.
        platform = _cache.get("default")
        if platform is not None:
            return platform
    cache = _current_cache()
    platform = cache["default"] = jax.default_backend()
    return platform


def _lookup_device(platform: str, local_id: int) -> Any:
    try:
        backend = jax.extend.backend.get_backend(platform)
    except RuntimeError as err:
        if platform != "cuda":
            raise
        cuda = torch.version.cuda or "12"
        raise RuntimeError(
            f"bridge_mr.dlpack: a CUDA tensor needs a JAX GPU backend, but JAX has none "
            f"(jax.devices() = {jax.devices()}; {err}). Install JAX with CUDA support matching "
            f'torch\'s CUDA {cuda}: pip install -U "jax[cuda{cuda.split(".")[0]}]", or move the '
            f"tensor to the CPU with .cpu()."
        ) from None
    try:
        return backend.device_from_local_hardware_id(local_id)
    except Exception as err:  # jaxlib raises its own runtime error type here
        raise RuntimeError(
            f"bridge_mr.dlpack: JAX's {platform} backend has no device with local id {local_id} "
            f"(JAX sees {backend.local_devices()}; {err}). Make torch and JAX see the same "
            f"devices (the same CUDA_VISIBLE_DEVICES for both)."
        ) from None


def jax_stream_for_imports(device: Any) -> int | None:
    """The stream on which JAX waits for externally produced buffers of `device`, if any."""
    try:
        return device.get_stream_for_external_ready_events()
    except Exception as err:  # jaxlib's runtime error type; UNIMPLEMENTED means "no stream"
        if "UNIMPLEMENTED" in str(err):
            return None
        raise


def torch_stream_pointer(index: int) -> int:
    """The current torch CUDA stream of device `index`, encoded as the DLPack protocol asks."""
    pointer = torch.cuda.current_stream(index).cuda_stream
    return 1 if pointer == 0 else pointer  # 1 is the legacy default stream in DLPack


def make_jax_stream_wait(index: int, jax_stream: int | None) -> None:
    """Makes `jax_stream` wait for the work queued so far on torch's current stream."""
    if jax_stream is None:
        torch.cuda.current_stream(index).synchronize()
        return
    current = torch.cuda.current_stream(index)
    if current.cuda_stream == jax_stream:
        return
    event = torch.cuda.Event()
    event.record(current)
    torch.cuda.ExternalStream(jax_stream, device=index).wait_event(event)


def host_program_device() -> Any:
    """The JAX device that programs of host (CPU) tensors run on, or None for the CPU.

    JAX's default device decides: the device `jax.default_device` sets (a device, or a
    platform's first device), else the first device of JAX's default backend. Where that is an
    accelerator (a TPU, a GPU), host tensors go to it once per call and outputs come back; where
    it is a CPU device, None: programs run on the CPU, sharing the tensors' memory.

    Returns:
      A JAX device, or None.

    Example:
      >>> bridge_mr.dlpack.host_program_device() is None  # on a machine with no accelerator
      True
      >>> with jax.default_device(jax.devices("cpu")[0]):  # on any machine: the CPU
      ...     bridge_mr.dlpack.host_program_device() is None
      True
    """
    device = default_device()
    if device is None:
        if default_platform() == "cpu":
            return None
        device = "default"
    if not isinstance(device, str):
        return None if device.platform == "cpu" else device
    cache = _current_cache()
    key = ("program device", device)
    if key not in cache:
        found = jax.devices()[0] if device == "default" else jax.devices(device)[0]
        cache[key] = None if found.platform == "cpu" else found
    return cache[key]


def host_device() -> Any:
    """JAX's first CPU device, where outputs of programs run elsewhere come back to.

    Returns:
      A JAX CPU device.

    Example:
      >>> bridge_mr.dlpack.host_device().platform
      'cpu'
    """
    return jax_device("cpu", 0)
