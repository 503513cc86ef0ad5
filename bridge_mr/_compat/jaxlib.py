"""jaxlib's DLPack entry points, called directly (the calls `jax.dlpack` makes itself).

Checked on jaxlib 0.10.2 (extension version 467). The signature of
`dlpack_managed_tensor_to_buffer` changed across releases; from extension version 467 on it is
`(capsule, device, stream, copy, dl_device_type)`, which is the only form bridge_mr calls, so
importing this module on an older jaxlib raises ImportError. Imports jax (jaxlib) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxlib._jax as _jax
import jaxlib.version
from jax._src.lib import jaxlib_extension_version as _EXTENSION_VERSION

__all__ = ["DL_CPU", "DL_CUDA", "EXTENSION_VERSION", "array_to_capsule", "capsule_to_array"]

#: The oldest jaxlib extension version (`jax._src.lib.jaxlib_extension_version`) supported.
EXTENSION_VERSION = 467

if _EXTENSION_VERSION < EXTENSION_VERSION:
    raise ImportError(
        f"bridge_mr.dlpack needs jaxlib 0.10.2 or newer (DLPack extension version >= "
        f"{EXTENSION_VERSION}); the installed jaxlib {jaxlib.version.__version__} has extension "
        f'version {_EXTENSION_VERSION}. Fix: pip install -U "jax>=0.10.2" "jaxlib>=0.10.2".'
    )

DL_CPU = 1  # DLDeviceType.kDLCPU
DL_CUDA = 2  # DLDeviceType.kDLCUDA

_to_buffer = _jax.dlpack_managed_tensor_to_buffer
_to_capsule = _jax.buffer_to_dlpack_managed_tensor


def capsule_to_array(capsule: Any, device: Any, stream: int | None, dl_device_type: int) -> Any:
    """Wraps a DLPack capsule as a `jax.Array` on `device`, sharing its memory.

    `jaxlib._jax.dlpack_managed_tensor_to_buffer(capsule, device, stream, None,
    dl_device_type)`, what `jax.dlpack.from_dlpack` calls after its argument checks. It aliases
    compact tensors whose start is 64-byte aligned (on CPU), and copies silently otherwise:
    callers pass only such tensors. jaxlib 0.10.2.

    Args:
      capsule: a DLPack capsule (e.g. from `torch.utils.dlpack.to_dlpack`), consumed.
      device: the JAX device the buffer lives on.
      stream: the stream JAX's reads are ordered on (CUDA), or None.
      dl_device_type: `DL_CPU` or `DL_CUDA`.

    Returns:
      A single-device `jax.Array` on `device`.
    """
    return _to_buffer(capsule, device, stream, None, dl_device_type)


#: A DLPack capsule sharing a single-device `jax.Array`'s buffer: `(array, stream)`, where
#: `stream` is the consumer's CUDA stream to order after the array's producer, or None (CPU).
#: `jaxlib._jax.buffer_to_dlpack_managed_tensor` itself, what `jax.Array.__dlpack__` calls (no
#: wrapper: it runs once per output of every call). The capsule holds `array` itself: calling
#: `array.delete()` while the capsule's tensor lives aborts the process (a jaxlib CHECK), so
#: export a fresh handle (`fresh_handle`) of any array someone else may delete. jaxlib 0.10.2.
array_to_capsule: Callable[[Any, int | None], Any] = _to_capsule
