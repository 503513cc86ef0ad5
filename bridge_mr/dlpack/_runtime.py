"""The JAX and torch entry points the converters call, resolved once, plus device lookup.

The fast entry points are the jaxlib and torch functions that `jax.dlpack.from_dlpack`,
`jax.Array.__dlpack__` and `torch.from_dlpack` themselves call; where the installed jaxlib does
not offer them in the expected form, the public functions are used instead. Nothing here
initialises a JAX backend at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch
from jax._src import xla_bridge
from jax._src.array import ArrayImpl

DL_CPU = 1  # DLDeviceType.kDLCPU
DL_CUDA = 2  # DLDeviceType.kDLCUDA

try:
    from jax._src.lib import _jax as _jaxlib
except ImportError:  # jaxlib without the `_jax` extension module name
    _jaxlib = None

_jaxlib_to_array = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)
_jaxlib_to_capsule = getattr(_jaxlib, "buffer_to_dlpack_managed_tensor", None)


def _capsule_to_array_5(
    capsule: Any, device: Any, stream: int | None, dl_device_type: int
) -> jax.Array:
    return _jaxlib_to_array(capsule, device, stream, None, dl_device_type)


def _capsule_to_array_4(
    capsule: Any, device: Any, stream: int | None, dl_device_type: int
) -> jax.Array:
    del dl_device_type  # This jaxlib reads it from the capsule.
    return _jaxlib_to_array(capsule, device, stream, None)


def _capsule_to_array_3(
    capsule: Any, device: Any, stream: int | None, dl_device_type: int
) -> jax.Array:
    del dl_device_type  # This jaxlib reads it from the capsule.
    return _jaxlib_to_array(capsule, device, stream)


def _pick_capsule_to_array() -> Callable[[Any, Any, int | None, int], jax.Array] | None:
    # The signature changed across jaxlib releases (jaxlib 0.7: dlpack, device, stream; later
    # `copy`, then `dl_device_type` were added); nanobind states it in the docstring.
    signature = getattr(_jaxlib_to_array, "__doc__", None) or ""
    if "device: " not in signature or "stream: " not in signature:
        return None
    if "dl_device_type" in signature:
        return _capsule_to_array_5
    if "copy" in signature:
        return _capsule_to_array_4
    return _capsule_to_array_3


#: Wraps a DLPack capsule as a jax.Array on `device` without copying (when the layout allows),
#: or None where this jaxlib has no such entry point and `jax.dlpack.from_dlpack` must be used.
capsule_to_array: Callable[[Any, Any, int | None, int], jax.Array] | None = _pick_capsule_to_array()


def _public_array_to_tensor(array: jax.Array, stream: int | None) -> torch.Tensor:
    del stream  # torch.from_dlpack asks JAX for the current torch stream itself.
    return torch.utils.dlpack.from_dlpack(array)


def _fast_array_to_tensor(array: jax.Array, stream: int | None) -> torch.Tensor:
    # The capsule must hold a fresh handle on the buffer, not `array` itself: exporting `array`
    # directly makes a later `array.delete()` abort the process (jaxlib 0.10 CHECK failure).
    return tensor_from_capsule(_jaxlib_to_capsule(_fresh_handle(array), stream=stream))


def _fast_owned_array_to_tensor(array: jax.Array, stream: int | None) -> torch.Tensor:
    # Taking a fresh handle costs ~5 µs (jaxlib builds a sharding through Python); an array
    # that nobody will `delete()` can be exported as it is.
    return tensor_from_capsule(_jaxlib_to_capsule(array, stream=stream))


_has_replicated_shard = hasattr(ArrayImpl, "_fully_replicated_shard")


def _fresh_handle(array: Any) -> Any:
    """A new single-device jax.Array object on the same buffer as `array`."""
    if _has_replicated_shard:
        return array._fully_replicated_shard()
    return array.addressable_data(0)


tensor_to_capsule: Callable[[torch.Tensor], Any] = torch.utils.dlpack.to_dlpack
tensor_from_capsule: Callable[[Any], torch.Tensor] = getattr(
    torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack
)

#: Wraps a single-device jax.Array as a torch tensor without copying. `stream` is the torch
#: CUDA stream that must wait for the array's producer (None on CPU).
array_to_tensor: Callable[[jax.Array, int | None], torch.Tensor] = (
    _public_array_to_tensor if _jaxlib_to_capsule is None else _fast_array_to_tensor
)

#: `array_to_tensor` for an array its caller owns alone and never deletes explicitly.
owned_array_to_tensor: Callable[[jax.Array, int | None], torch.Tensor] = (
    _public_array_to_tensor if _jaxlib_to_capsule is None else _fast_owned_array_to_tensor
)

try:
    from jax._src.config import enable_x64 as _enable_x64_state

    def x64_enabled() -> bool:
        """Whether JAX 64-bit types are enabled in the current thread and context."""
        return bool(_enable_x64_state.value)

except ImportError:

    def x64_enabled() -> bool:
        """Whether JAX 64-bit types are enabled in the current thread and context."""
        return bool(jax.config.jax_enable_x64)


try:
    from jax._src.config import default_device as _default_device_state

    def default_device() -> Any:
        """The `jax.default_device` in effect here (a Device, a platform name, or None)."""
        return _default_device_state.value

except ImportError:

    def default_device() -> Any:
        """The `jax.default_device` in effect here (a Device, a platform name, or None)."""
        return jax.config.jax_default_device


# Devices and the default platform, looked up once per set of backends: `jax.clear_backends()`
# replaces the backends dict the cache was filled from.
_cache: dict[Any, Any] = {}
_cache_owner: list[object] = [None]


def _current_cache() -> dict[Any, Any]:
    if xla_bridge._backends is not _cache_owner[0]:
        _cache.clear()
        _cache_owner[0] = xla_bridge._backends
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
    cache = _current_cache()
    platform = cache.get("default")
    if platform is None:
        platform = cache["default"] = jax.default_backend()
    return platform


def _lookup_device(platform: str, local_id: int) -> Any:
    try:
        backend = xla_bridge.get_backend(platform)
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
