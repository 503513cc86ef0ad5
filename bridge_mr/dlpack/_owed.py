"""Imports whose release XLA's threads still owe, settled before the interpreter finalizes.

A torch tensor imported over DLPack lives on through its capsule until JAX's last hold on the
buffer goes: the array, or an execution or a transfer that reads it. Those end on XLA's worker
threads, and torch's capsule deleter then takes the GIL (it drops the tensor's Python object).
While the interpreter finalizes, CPython ends any thread that takes the GIL with
`pthread_exit`; inside XLA's destructor, which is noexcept, that is `std::terminate`
("terminate called without an active exception", exit status 134). A process whose last
`map_reduce` call imported a tensor so (the backward's cotangent of a vector result, copied
because autograd hands it over expanded) aborted at exit about 1 time in 8: the runner waits for
the call's outputs, but the execution lets go of its inputs only after signalling them, and the
main thread could reach finalization first.

So the importers hand DLPack a handle of their own (`handle`: a detached alias, which only the
capsule keeps alive) and record it weakly; `settle`, registered with `atexit` when this module
is imported (after jax, so it runs before JAX's own hook, which tears the backends down), waits
with the GIL free until every recorded handle whose buffer no live JAX array holds is released:
those releases are the ones XLA's threads still owe. The others go with their arrays, released
by the main thread during finalization, which may take the GIL. Nothing of torch's or JAX's is
changed. What the hook cannot cover: an array the user keeps alive to the end while a
computation that reads it is still running (JAX's own DLPack import has the same hazard).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref

import jax
import torch

#: The longest the interpreter's exit waits for XLA's threads to release imported tensors (a
#: finished execution releases its inputs within microseconds; a running one when it ends).
EXIT_WAIT_SECONDS = 5.0
_POLL_SECONDS = 1e-3

_LOG = logging.getLogger("bridge_mr")

# The handles of imports whose capsules live: each dies with its capsule's release.
_HANDLES: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
#: Records a handle (`handle` does; `_import_all` inlines it).
record = _HANDLES.add


def handle(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to hand to DLPack for `tensor`: an alias that only the capsule keeps alive
    (so its life shows whether JAX still holds the buffer), recorded for `settle`."""
    alias = tensor.detach()  # Also what keeps the capsule from holding the autograd graph.
    record(alias)
    return alias


def owed() -> list[torch.Tensor]:
    """The recorded handles whose buffer no live JAX array holds: releases still owed."""
    handles = list(_HANDLES)
    if not handles:
        return []
    held = _held_pointers({"cpu" if h.is_cpu else "gpu" for h in handles})
    return [h for h in handles if h.data_ptr() not in held]


def settle(timeout: float = EXIT_WAIT_SECONDS) -> bool:
    """Waits, with the GIL free, until XLA's threads have released every import they still
    hold (`owed`), or `timeout` seconds.

    Args:
      timeout: the longest wait, in seconds.

    Returns:
      Whether nothing is owed any more.
    """
    deadline = time.monotonic() + timeout
    # `owed()`'s list is dropped before each sleep: holding the handles would keep them alive.
    while owed():
        if time.monotonic() >= deadline:
            _LOG.debug("bridge_mr: XLA still holds imported tensors after %.1f s", timeout)
            return False
        time.sleep(_POLL_SECONDS)  # Lets a worker thread that waits for the GIL take it.
    return True


def _held_pointers(platforms: set[str]) -> set[int]:
    """The buffer addresses of the live JAX arrays on these platforms."""
    held: set[int] = set()
    for platform in platforms:
        try:
            arrays = jax.live_arrays(platform)
        except RuntimeError:  # No such backend.
            continue
        for array in arrays:
            try:
                if array.is_deleted():
                    continue
                if len(array.sharding.device_set) == 1:
                    held.add(array.unsafe_buffer_pointer())
                else:
                    held.update(s.data.unsafe_buffer_pointer() for s in array.addressable_shards)
            except RuntimeError:  # jaxlib's error for a buffer it cannot point at.
                continue
    return held


atexit.register(settle)
