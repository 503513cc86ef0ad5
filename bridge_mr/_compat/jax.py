"""Private names of jax that bridge_mr relies on, each behind one accessor.

Checked on jax 0.10.2 (the version CI pins, in both test environments). Imports jax only.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import mesh as _mesh
from jax._src import util as _util
from jax._src import xla_bridge as _xla_bridge
from jax._src.array import ArrayImpl as ArrayImpl
from jax._src.export.shape_poly import _DimExpr as DimExpr
from jax.sharding import Mesh, SingleDeviceSharding

__all__ = [
    "ArrayImpl",
    "ClearCounter",
    "DimExpr",
    "backends_generation",
    "clear_counter",
    "concrete_mesh",
    "default_device",
    "fresh_handle",
    "legacy_mesh",
    "shardy_partitioner",
    "single_devices",
    "trace_context",
    "transfer_guard_host_to_device",
    "x64_enabled",
]

#: `ArrayImpl` (imported above) is the class of every concrete `jax.Array` (`jax.Array` itself is
#: an abstract base that tracers also claim); `type(x) is ArrayImpl` is the cheap exact test.
#: `jax._src.array.ArrayImpl`; jax 0.10.2.
#:
#: `DimExpr` is the class of `jax.export` symbolic dimensions (`jax.export.symbolic_shape("n")`),
#: which jax types as `Any` in its public signatures. `jax._src.export.shape_poly._DimExpr`;
#: jax 0.10.2.

_X64 = _config.enable_x64
_DEFAULT_DEVICE = _config.default_device
_TRANSFER_GUARD_H2D = _config.transfer_guard_host_to_device


#: What of JAX's configuration a trace depends on (x64, promotion, precision, mesh, ...):
#: `jax.jit` keys its own trace cache with this value, so a cache keyed with it never reuses a
#: trace that jit would redo after a `jax.config.update` or a config context manager.
#: `jax._src.config.trace_context` itself (no wrapper: it is read on every torch call);
#: jax 0.10.2.
trace_context: Callable[[], Hashable] = _config.trace_context


def concrete_mesh() -> Mesh | None:
    """The concrete mesh set with `jax.set_mesh` in this thread, or None when none is set.

    `jax._src.mesh.get_concrete_mesh`; jax 0.10.2.
    """
    mesh = _mesh.get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def legacy_mesh() -> Mesh | None:
    """The mesh of an enclosing legacy `with mesh:` block in this thread, or None.

    Read from `jax._src.mesh.thread_resources`; its public alias
    `jax.interpreters.pxla.thread_resources` warns (deprecated since jax 0.8.2), and no other
    public API sees a legacy mesh. jax 0.10.2.
    """
    mesh = _mesh.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def shardy_partitioner(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """A context in which this thread lowers with (`True`) or without Shardy (GSPMD).

    JAX's thread-local config context `jax._src.config.use_shardy_partitioner(enabled)`: other
    threads keep their setting, unlike `jax.config.update("jax_use_shardy_partitioner", ...)`,
    which is process-global. jax 0.10.2.

    Args:
      enabled: whether lowering inside the block uses the Shardy partitioner.

    Returns:
      A context manager; the previous setting is restored on exit.
    """
    return _config.use_shardy_partitioner(bool(enabled))


def x64_enabled() -> bool:
    """Whether JAX's 64-bit mode is on in the current thread and config context.

    `jax._src.config.enable_x64.value` (the thread-local value that `jax.jit` also reads);
    jax 0.10.2.
    """
    return bool(_X64.value)


#: The `jax.default_device` in effect here: a Device, a platform name, or None.
#: `jax._src.config.default_device.value`, read by a C accessor (no Python frame on the hot
#: path); jax 0.10.2.
default_device: Callable[[], Any] = functools.partial(operator.attrgetter("value"), _DEFAULT_DEVICE)

#: The `jax.transfer_guard_host_to_device` level in effect here ("allow", "log", "disallow",
#: their "explicit" forms), or None when none is set. `jax._src.config.
#: transfer_guard_host_to_device.value`, read by a C accessor; jax 0.10.2.
transfer_guard_host_to_device: Callable[[], str | None] = functools.partial(
    operator.attrgetter("value"), _TRANSFER_GUARD_H2D
)

#: An object that stays the same until `jax.extend.backend.clear_backends()` is called: the
#: identity of `jax._src.xla_bridge._backends`, which `clear_backends` rebinds to a new dict
#: (caches of devices compare it with `is`). Read by a C accessor; jax 0.10.2.
backends_generation: Callable[[], object] = functools.partial(
    operator.attrgetter("_backends"), _xla_bridge
)


def single_devices(arrays: Sequence[Any]) -> list[Any]:
    """The device of each committed single-device `ArrayImpl`, None for anything else.

    Reads `SingleDeviceSharding._device`, which the public `device_set` builds a set for; for
    all of a call's outputs in one call. jax 0.10.2.
    """
    devices = []
    for array in arrays:
        device = None
        if type(array) is ArrayImpl:
            sharding = array.sharding
            if type(sharding) is SingleDeviceSharding:
                device = sharding._device
        devices.append(device)
    return devices


def fresh_handle(array: jax.Array) -> jax.Array:
    """A new single-device `jax.Array` object on the same buffer as a single-device `array`.

    `ArrayImpl._fully_replicated_shard()`, which builds no Shard objects (unlike the public
    `array.addressable_data(0)`); jax 0.10.2.
    """
    # A method of jaxlib's C++ ArrayImpl, which jax's stub of `jax.Array` does not declare.
    return array._fully_replicated_shard()  # pyright: ignore[reportAttributeAccessIssue]


class ClearCounter:
    """Counts `jax.clear_caches()` calls in `count`: JAX's cache management calls `cache_clear()`
    on every cache registered with it (`jax._src.util.register_cache`; jax 0.10.2)."""

    def __init__(self) -> None:
        self.count = 0

    def cache_clear(self) -> None:
        self.count += 1

    def cache_info(self) -> None:
        return None

    def cache_keys(self) -> tuple[()]:
        return ()


@functools.cache
def clear_counter() -> ClearCounter:
    """The one counter of `jax.clear_caches()` calls (from its first use on): read its `count`
    attribute, a hot path's cheapest check."""
    counter = ClearCounter()
    _util.register_cache(counter, "bridge_mr: jax.clear_caches() calls")
    return counter
