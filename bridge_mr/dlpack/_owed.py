"""Imports whose release XLA's threads may still owe, made safe before the interpreter finalizes.

A torch tensor imported over DLPack lives on through its capsule until JAX's last hold on the
buffer goes: the array, or an execution or a transfer that reads it. Those end on XLA's worker
threads, and torch's capsule deleter then takes the GIL (the capsule's reference was the last
C++ one, so torch drops the tensor's Python object: `TensorImpl::decref_pyobject`). While the
interpreter finalizes, CPython ends any thread that takes the GIL with `pthread_exit`; inside
XLA's destructor, which is noexcept, that is `std::terminate` ("terminate called without an
active exception", exit status 134). A process whose last `map_reduce` call imported a tensor so
(the backward's cotangent of a vector result, copied because autograd hands it over expanded)
aborted at exit about 1 time in 8: the runner waits for the call's outputs, but the execution
lets go of its inputs only after signalling them, and the main thread could reach finalization
first.

So the importers hand DLPack a handle of their own (`handle`: a detached alias, which only the
capsule keeps alive) and record it weakly, and `settle`, registered with `atexit` when this
module is imported (after jax, so it runs before JAX's own hook, which tears the backends down),
makes every such release safe before finalization begins:

* A handle whose capsule JAX still holds (a live array, or an execution or transfer that has
  not let go yet) is pinned: `settle` takes one more C++ reference on its tensor (a capsule of
  its own, never released: the process is ending, and the memory goes with it). JAX's release
  is then not torch's last C++ reference, and torch's deleter does not touch the GIL at all,
  whichever thread runs it and whenever. A pin is kept only if the capsule is seen alive after
  it was taken (`Tensor._use_count()`: the alias's Python object, the pin, the capsule);
  otherwise the release raced it, and the pin is dropped again on this thread.
* A handle whose capsule is already released (use count 1) is a release in flight: a worker
  has dropped the capsule's reference and is about to take the GIL to drop the alias. `settle`
  waits for it with the GIL free.
* The deleter's GIL section is not one piece: torch drops the alias's Python object (which
  clears its weak references, so the handle vanishes from the record) and then, in
  `THPVariable_clear`, lets the GIL go while it frees the tensor and takes it back after. A
  wait that ends when the record is empty can end inside that gap; the main thread then holds
  the GIL into finalization and the worker dies taking it back. This was the residual abort
  (1 exit in 40 with 8 CPU devices on a loaded CI machine; 15 of 24 with the gap widened to
  20 ms by an LD_PRELOAD shim). The worker's thread state (the one pybind11 creates for the
  deleter and deletes as it lets the GIL go for good) lives through the whole section, gap
  included, and it is the only thread state without a Python frame; so `settle` also waits
  until no thread state but its own lacks a Python frame. That covers any C++ thread in the
  middle of a GIL section, whatever its cause.

Both checks run with the GIL held, back to back, so nothing a worker owes can slip between them.
A torch that counts references otherwise (`pinnable`: where the tensor owns its
Python object once only C++ holds it, as before torch's current scheme) is not pinned: `settle`
then waits, as it did before, for every handle whose buffer no live JAX array holds (`owed`),
and for the frameless thread states. Nothing of torch's or JAX's is changed; the thread states
are read through CPython's public C API (`PyInterpreterState_ThreadHead`, `PyThreadState_Next`,
`PyThreadState_GetFrame`). A foreign thread that keeps a frameless thread state (a C thread
parked inside a GIL section) makes the exit wait `EXIT_WAIT_SECONDS` and then go on.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import time
import weakref
from typing import Any

import jax  # Imported first: its atexit hook then runs after `settle`.
import torch

from bridge_mr._compat import torch as torch_compat

from . import _runtime

#: The longest the interpreter's exit waits for XLA's threads to finish the releases they have
#: begun (one takes microseconds, unless its thread is kept off a busy CPU).
EXIT_WAIT_SECONDS = 5.0
_POLL_SECONDS = 1e-3

_LOG = logging.getLogger("bridge_mr")

# The handles of imports whose capsules live and that `settle` has not pinned: each dies with
# its capsule's release.
_HANDLES: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
#: Records a handle (`handle` does; `_import_all` inlines it).
record = _HANDLES.add

# Use counts of a handle's tensor: its Python object's own reference, the capsule's, a pin's.
_CAPSULE_HELD = 2
_PINNED_AND_HELD = 3

# CPython's C API, called with the GIL held (`ctypes.pythonapi` never lets it go).
_API: Any = ctypes.pythonapi
_API.PyInterpreterState_Get.restype = ctypes.c_void_p
_API.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
_API.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
_API.PyThreadState_Next.restype = ctypes.c_void_p
_API.PyThreadState_Next.argtypes = [ctypes.c_void_p]
_API.PyThreadState_Get.restype = ctypes.c_void_p
_API.PyThreadState_GetFrame.restype = ctypes.c_void_p
_API.PyThreadState_GetFrame.argtypes = [ctypes.c_void_p]
_API.Py_DecRef.argtypes = [ctypes.c_void_p]


def handle(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to hand to DLPack for `tensor`: an alias that only the capsule keeps alive
    (so its life shows whether JAX still holds the buffer), recorded for `settle`."""
    alias = tensor.detach()  # Also what keeps the capsule from holding the autograd graph.
    record(alias)
    return alias


def owed() -> list[torch.Tensor]:
    """The recorded handles whose buffer no live JAX array holds: releases still owed (what
    `settle` waits for where it cannot pin)."""
    handles = list(_HANDLES)
    if not handles:
        return []
    held = _held_pointers({"cpu" if h.is_cpu else "gpu" for h in handles})
    return [h for h in handles if h.data_ptr() not in held]


def settle(timeout: float = EXIT_WAIT_SECONDS) -> bool:
    """Makes every release of an imported tensor safe to come during finalization: pins those
    whose capsule JAX still holds and waits, with the GIL free, until no release has begun
    that still needs the GIL (see the module docstring). For the interpreter's exit: a pinned
    tensor is never freed.

    Args:
      timeout: the longest wait, in seconds.

    Returns:
      Whether nothing is owed any more.
    """
    deadline = time.monotonic() + timeout
    pins: list[Any] = []
    _API.Py_IncRef(ctypes.py_object(pins))  # Never freed, not even when modules are cleared.
    pinning = pinnable()
    while True:
        if pinning:
            _pin_all(pins)
        # With the GIL held from here to the return: no release can begin or end in between.
        if not _still_owed(pinning) and not _frameless_thread_states():
            return True
        if time.monotonic() >= deadline:
            _LOG.debug(
                "bridge_mr: after %.1f s, %d imported tensors are still being released, "
                "%d other threads are inside a GIL section",
                timeout,
                len(_HANDLES),
                _frameless_thread_states(),
            )
            return False
        time.sleep(_POLL_SECONDS)  # Lets a worker thread that waits for the GIL take it.


def _still_owed(pinning: bool) -> bool:
    # No list of handles outlives the call: holding them while `settle` sleeps would keep them
    # alive.
    return bool(_HANDLES) if pinning else bool(owed())


def _pin_all(pins: list[Any]) -> None:
    """Pins every recorded handle whose capsule JAX still holds, and forgets it."""
    # Forgotten by its weak reference: `WeakSet.discard` would compare tensors with `==`.
    refs: set[weakref.ref[torch.Tensor]] = _HANDLES.data  # pyright: ignore[reportAttributeAccessIssue]
    for ref in list(refs):
        alias = ref()
        if alias is not None and _pin(alias, pins):
            refs.discard(ref)


def _pin(alias: Any, pins: list[Any]) -> bool:
    """Takes a reference on `alias`'s tensor into `pins` if a capsule still holds it; False
    where its release has begun (then it is left to finish)."""
    if torch_compat.use_count(alias) < _CAPSULE_HELD:
        return False
    pin = _runtime.tensor_to_capsule(alias)
    if torch_compat.use_count(alias) < _PINNED_AND_HELD:
        # Released meanwhile: perhaps before the pin, whose reference would then revive the
        # alias the worker is about to drop. Dropped here, with the GIL held.
        del pin
        return False
    pins.append(pin)
    return True


def pinnable() -> bool:
    """Whether this torch counts a recorded handle's references as pinning expects: its Python
    object holds one while a capsule holds another (torch 2.13 does; torch releases whose
    Python object, once only C++ holds the tensor, is owned by the tensor instead count the
    capsule alone, and then `settle` waits, as for an unpinned handle)."""
    probe = torch.empty(0).detach()
    ref = weakref.ref(probe)
    capsule = _runtime.tensor_to_capsule(probe)
    del probe
    alias: Any = ref()
    counted = alias is not None and torch_compat.use_count(alias) == _CAPSULE_HELD
    del alias, capsule
    return counted


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


def _frameless_thread_states() -> int:
    """How many of the interpreter's thread states, this thread's aside, have no Python frame:
    C threads inside a GIL section (a Python thread has one from its start to its end, but for
    the moment it takes to start or end)."""
    own = _API.PyThreadState_Get()
    count = 0
    state = _API.PyInterpreterState_ThreadHead(_API.PyInterpreterState_Get())
    while state:
        if state != own:
            frame = _API.PyThreadState_GetFrame(state)
            if frame:
                _API.Py_DecRef(frame)
            else:
                count += 1
        state = _API.PyThreadState_Next(state)
    return count


atexit.register(settle)
