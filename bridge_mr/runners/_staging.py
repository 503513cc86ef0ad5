"""Staging buffers: small CPU inputs copied into memory that JAX has already imported.

A call of a `DlpackRunner` packs its small same-dtype inputs into one buffer per dtype. On the
CPU that buffer need not be new on every call: a runner keeps one torch buffer per group,
imports each into JAX once (a `jax.Array` sharing its memory), and copies the group's tensors
into it with one `torch._foreach_copy_`. The program then takes arrays that JAX already holds,
instead of a fresh torch allocation that JAX imports on every call (benchmarks/results/NOTES.md,
"staging": ~20-35 us per call of the tiny `map_reduce`).

JAX assumes its arrays never change; these change only between executions: a call fills the
buffers, runs, waits for its outputs (all outputs of one execution complete together, after
every read of its inputs) and only then lets the next call fill them (`lock`). A call that
finds them taken (another thread's call in flight) packs fresh buffers as before.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import Aval, torch_dtype
from bridge_mr.dlpack import jit_arguments


class Staging:
    """One imported CPU buffer per packed group of a runner's inputs.

    Args:
      groups: the runner's packed groups (indices of its tensor inputs).
      crossing: the groups' buffers as the runner's first call passed them to JAX (numpy views
        or imported arrays: what a compile after `jax.clear_caches()` lowers with).
      arrays: the JAX arrays that share the buffers' memory, one per group.
      views: one view of a buffer per member of the groups, in their order, shaped as the
        member.
      placement: JAX's default device and host-to-device transfer guard when the buffers were
        placed: under others the runner's other inputs may go elsewhere, so it packs fresh
        buffers, as the first call did.
    """

    def __init__(
        self,
        groups: tuple[tuple[int, ...], ...],
        crossing: list[Any],
        arrays: list[jax.Array],
        views: list[torch.Tensor],
        placement: tuple[Any, Any],
    ) -> None:
        self.crossing = crossing
        self.arrays = arrays
        self.lock = threading.Lock()
        self._order = [i for group in groups for i in group]
        self._views = views
        self._placement = placement

    def fill(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Copies `tensors`' group members into the buffers and returns True with `lock` held
        (the caller releases it once its outputs are ready); False where the lock is taken, a
        member is not a plain tensor (a subclass, such as a cotangent autograd hands over, must
        meet the fresh path's checks) or JAX's placement changed: the caller packs fresh
        buffers."""
        if _placement() != self._placement or not self.lock.acquire(blocking=False):
            return False
        try:
            members = []
            for i in self._order:
                member = tensors[i]
                if type(member) is not torch.Tensor:
                    self.lock.release()
                    return False
                members.append(member)
            if torch.is_grad_enabled():
                # A copy from a tensor that requires grad would record itself on the buffers.
                with torch.no_grad():
                    torch_compat.foreach_copy(self._views, members)
            else:
                torch_compat.foreach_copy(self._views, members)
        except BaseException:
            self.lock.release()
            raise
        return True


def _placement() -> tuple[Any, Any]:
    """What decides where jax.jit places a runner's uncommitted inputs (`jit_arguments` reads
    the same): the default device and the host-to-device transfer guard."""
    return jax_compat.default_device(), jax_compat.transfer_guard_host_to_device()


def staging_for(
    groups: tuple[tuple[int, ...], ...],
    in_avals: Sequence[Aval],
    tensors: Sequence[torch.Tensor],
    device: Any,
) -> Staging | None:
    """A `Staging` for a runner whose last call ran on the JAX CPU `device` with these
    `tensors`, or None where the groups' tensors are not all plain CPU tensors or JAX would not
    share the buffers' memory on that device."""
    if device is None or getattr(device, "platform", None) != "cpu":
        return None
    for group in groups:
        for i in group:
            tensor = tensors[i]
            if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
                return None
    buffers: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    # An inference tensor (made under torch.inference_mode) could not be written outside it;
    # `device`: not torch's default device (`torch.set_default_device`, `with torch.device`).
    with torch.inference_mode(False):
        for group in groups:
            sizes = [math.prod(in_avals[i][0]) for i in group]
            dtype = torch_dtype(in_avals[group[0]][1])
            buffer = torch.empty(sum(sizes), dtype=dtype, device="cpu")
            offset = 0
            for i, size in zip(group, sizes, strict=True):
                views.append(buffer[offset : offset + size].view(in_avals[i][0]))
                offset += size
            buffers.append(buffer)
    placement = _placement()
    # As the first call passed its packed buffers (`jit_arguments`: a numpy view on the CPU,
    # which jit places uncommitted; else an imported array): a committed array where the
    # program was compiled for uncommitted ones would make jax.jit compile it again.
    crossing = list(jit_arguments(buffers))
    arrays = []
    for given, buffer in zip(crossing, buffers, strict=True):
        array = jax.device_put(given, may_alias=True) if isinstance(given, np.ndarray) else given
        if array.unsafe_buffer_pointer() != buffer.data_ptr() or array.devices() != {device}:
            return None
        arrays.append(array)
    return Staging(groups, crossing, arrays, views, placement)
