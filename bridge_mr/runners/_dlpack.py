"""The DLPack runner: CPU and CUDA tensors cross into JAX without copies, outputs cross back."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import NARROW_TARGETS, Aval
from bridge_mr.dlpack import export_arrays, host_device, jit_arguments

from . import _disk
from ._protocols import Jitted
from ._staging import Staging, staging_for

# Small tensors of one dtype cross together in one shared buffer: importing a tensor costs more
# than copying a small one (benchmarks/results/NOTES.md, "packing").
_PACK_BYTES = 64 * 1024

# Inputs and outputs of at least this size that cross between the host and an accelerator cross
# as a dense 2-D array when their own shape would be padded there by at least `_DENSE_PADDING`
# (`crossing_shape`).
_DENSE_BYTES = 1 << 20
_DENSE_PADDING = 1.25
# The widths such an input may take, widest first: a multiple of a TPU tile's 128 lanes.
_DENSE_WIDTHS = (1024, 512, 256, 128)

# Results that come within this time are polled for: waking a thread that sleeps on a result
# costs about as long as a tiny program runs on a busy or virtualised machine.
_POLL_SECONDS = 100e-6


class _Pollable(Protocol):
    def is_ready(self) -> bool: ...


def trace_context() -> contextlib.AbstractContextManager[Any]:
    """The JAX context DLPack programs are traced in: the caller's own (nothing changes)."""
    return contextlib.nullcontext()


def _pack_groups(avals: Sequence[Aval]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Groups of indices of small same-dtype values that share a buffer, and the rest.

    int32 / uint32 inputs are never packed: while x64 is off an int64 / uint64 tensor may stand
    for one, which `jit_arguments` narrows after checking its values, naming it in the error.
    """
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, (shape, dtype) in enumerate(avals):
        if dtype not in NARROW_TARGETS and math.prod(shape) * dtype.itemsize <= _PACK_BYTES:
            by_dtype.setdefault(dtype, []).append(i)
    groups = tuple(tuple(ix) for ix in by_dtype.values() if len(ix) > 1)
    grouped = {i for group in groups for i in group}
    return groups, tuple(i for i in range(len(avals)) if i not in grouped)


def crossing_shape(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, int] | None:
    """The 2-D shape a large array crosses between the host and an accelerator in, or None.

    A TPU holds an array in tiles of 8 rows (16 for 2-byte, 32 for 1-byte dtypes) by 128
    lanes over its last two dimensions, and a copy between the host and the chip moves the
    padded tiles: CNN images f32[50, 5, 10, 3, 32, 32] (30.7 MB, 4x padded) took 12.9 ms to
    cross to a v5e, the same bytes as [7500, 1024] 5.3 ms and as one 1-D array 7.4 ms; an output
    of that shape took 7.0 ms to come back, as [7500, 1024] 3.7 ms (docs/tpu.md). An input
    padded by a quarter or more, or 1-D, crosses as [size / width, width] and the program
    reshapes it back on the device; such an output is reshaped so in the program and back on
    the host, where that costs no copy. On a TPU the reshape is a copy on the chip (about twice the
    array's bytes of its memory traffic), so an array padded less (GPT-2's f32[50257, 768] by 7
    rows) crosses as it is; below 1 MiB it always does (a 73 KB kernel 113x padded crossed in
    0.73 ms as it is, 1.16 ms dense). Elsewhere (a GPU, a CPU device) the reshape is free, so
    the rule does not depend on the device.

    Example:
      >>> crossing_shape((50, 5, 10, 3, 32, 32), np.dtype("float32"))
      (7500, 1024)
      >>> crossing_shape((128, 12544), np.dtype("float32")) is None  # already dense
      True
    """
    size = math.prod(shape)
    if size * dtype.itemsize < _DENSE_BYTES:
        return None
    if len(shape) >= 2:
        rows = 8 * max(1, 4 // dtype.itemsize)
        tiles = -(-shape[-2] // rows) * rows * -(-shape[-1] // 128) * 128
        if math.prod(shape[:-2]) * tiles < _DENSE_PADDING * size:
            return None
    for width in _DENSE_WIDTHS:
        if size % width == 0:
            return None if shape == (size // width, width) else (size // width, width)
    return None


class DlpackRunner:
    """Imports tensors without copying (small ones packed per dtype), runs, waits, exports.

    Args:
      jitted: the jitted program; its inputs are the tensors followed by carried values.
      in_avals: shapes and dtypes of the tensor inputs.
      n_exported: how many leading outputs come back as torch tensors; the rest stay JAX
        arrays (carried, e.g. VJP residuals for a later program on this runner).
      mesh: a multi-device mesh the program shards over: tensor inputs are replicated over it
        and exported outputs gathered, so torch sees one device. None for one device.
      compiler_options: XLA options to compile `jitted` with (`jitted` itself must have none:
        jax.jit takes them at the top level only).
      names: what `jit_arguments`' errors call each tensor input (a packed buffer: its tensors'
        names joined by " + "; see `runner_for`); default `tensors[i]`.
      device: the JAX device the program runs on, for CPU tensors whose programs run on an
        accelerator (`bridge_mr.dlpack.host_program_device()`): the inputs go there once per
        call and the exported outputs come back to the CPU, large padded ones of either as
        dense 2-D arrays (`crossing_shape`). None: where the tensors are.
    """

    def __init__(
        self,
        jitted: Jitted,
        in_avals: Sequence[Aval],
        n_exported: int,
        mesh: Mesh | None,
        compiler_options: Mapping[str, str] | None = None,
        names: Sequence[str] | None = None,
        device: Any = None,
    ) -> None:
        self._jitted = jitted
        self._device = None if mesh is not None else device
        self._host = None if self._device is None else host_device()
        self._in_avals = list(in_avals)
        self._groups, self._singles = _pack_groups(in_avals)
        if names is None:
            names = [f"tensors[{i}]" for i in range(len(in_avals))]
        # Named as `jit_arguments` sees them: the packed buffers, then the single tensors.
        self._crossing_names = [
            *(" + ".join(names[i] for i in group) for group in self._groups),
            *(names[i] for i in self._singles),
        ]
        self._single_names = self._crossing_names[len(self._groups) :]  # Beside staged groups.
        # Single inputs that cross to the accelerator as a dense 2-D array, and in what shape.
        self._dense: dict[int, tuple[int, int]] = {}
        if self._device is not None:
            for i in self._singles:
                dense = crossing_shape(*self._in_avals[i])
                if dense is not None:
                    self._dense[i] = dense
        # Exported outputs that come back from the accelerator as a dense 2-D array: index ->
        # (shape, dense shape). Known once the first call's inputs are (`_dense_outputs`).
        self._dense_out: dict[int, tuple[tuple[int, ...], tuple[int, int]]] | None = (
            None if self._device is not None else {}
        )
        self._n_exported = n_exported
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        wrap = self._groups or self._replicated is not None or self._device is not None
        # jax.jit takes compiler options at the top level only: this one.
        self._options = dict(compiler_options) if compiler_options else None
        run = self._unpacking if wrap else jitted
        self._jit: Any = (
            jax.jit(run, compiler_options=self._options) if wrap or self._options else jitted
        )
        # With programs kept on disk (`_disk`): one compiled program per layout of the inputs
        # (a transposed tensor crosses as a column-major array, and a compiled program takes
        # only the layouts it was compiled for; jax.jit without the disk keys its own programs
        # so). Looked up again after `jax.clear_caches()`, which retraces `jax.jit` programs:
        # the count they belong to.
        self._clears = jax_compat.clear_counter()
        self._compiled_at: int | None = None
        self._folder: Path | None = None
        self._programs: dict[tuple[Any, ...], Any] = {}
        self._poll = True
        # Decided after the first call that ran with outputs to wait for (`_staging`).
        self._staging: Staging | None = None
        self._staging_decided = (
            not self._groups or self._replicated is not None or self._device is not None
        )

    def _unpacking(self, *flat: jax.Array) -> list[jax.Array]:
        n_in = len(self._groups) + len(self._singles)
        arrays: list[Any] = [None] * len(self._in_avals)
        for group, buffer in zip(self._groups, flat, strict=False):
            offset = 0
            for i in group:
                shape, _ = self._in_avals[i]
                size = math.prod(shape)
                arrays[i] = buffer[offset : offset + size].reshape(shape)
                offset += size
        for i, array in zip(self._singles, flat[len(self._groups) : n_in], strict=True):
            arrays[i] = array.reshape(self._in_avals[i][0]) if i in self._dense else array
        outputs = self._jitted(*arrays, *flat[n_in:])
        if self._dense_out:
            outputs = list(outputs)
            for k, (shape, dense) in self._dense_out.items():
                if outputs[k].shape != shape:
                    raise ValueError(
                        f"outputs[{k}]: the runner's first call made it {shape}, this call "
                        f"{outputs[k].shape}. Fix: pass tensors of the shapes the runner was made "
                        f"for."
                    )
                outputs[k] = outputs[k].reshape(dense)
        if self._replicated is None:
            return outputs
        n = self._n_exported
        return [*(jax.device_put(o, self._replicated) for o in outputs[:n]), *outputs[n:]]

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        staging = self._staging
        staged = None
        try:
            if staging is not None and staging.fill(tensors):
                staged = staging
            outputs = self._execute(tensors, carried, staged)
        finally:
            if staged is not None:
                staged.lock.release()
        if not self._staging_decided and outputs:
            self._staging_decided = True
            device = jax_compat.single_devices(outputs[:1])[0]
            self._staging = staging_for(self._groups, self._in_avals, tensors, device)
        n = self._n_exported
        exported = outputs[:n]
        if self._host is None:
            # Fresh outputs that only this runner holds, and drops.
            return export_arrays(exported, sole_owner=True), outputs[n:]
        # Ran on an accelerator: back to the tensors' CPU, dense outputs in their own shape.
        tensors = export_arrays(jax.device_put(exported, self._host), sole_owner=True)
        for k, (shape, _) in (self._dense_out or {}).items():
            # The same memory in its shape, not a view: torch refuses in-place changes to a view
            # that an autograd Function (bridge_mr's call) returns.
            dense = tensors[k]
            strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
            tensors[k] = torch.empty(0, dtype=dense.dtype).set_(
                dense.untyped_storage(), int(dense.storage_offset()), shape, strides
            )
        return tensors, outputs[n:]

    def _dense_outputs(
        self, arrays: Sequence[Any], carried: Sequence[Any]
    ) -> dict[int, tuple[tuple[int, ...], tuple[int, int]]]:
        """Which exported outputs cross back as dense 2-D arrays, from the first call's inputs."""
        structs: list[Any] = [None] * len(self._in_avals)
        for group, buffer in zip(self._groups, arrays, strict=False):
            for i in group:
                structs[i] = jax.ShapeDtypeStruct(self._in_avals[i][0], buffer.dtype)
        for i, array in zip(self._singles, arrays[len(self._groups) :], strict=True):
            structs[i] = jax.ShapeDtypeStruct(self._in_avals[i][0], array.dtype)
        outputs = jax.eval_shape(self._jitted, *structs, *carried)[: self._n_exported]
        dense = {}
        for k, output in enumerate(outputs):
            shape = crossing_shape(output.shape, np.dtype(output.dtype))
            if shape is not None:
                dense[k] = (output.shape, shape)
        return dense

    def _execute(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any], staged: Staging | None
    ) -> list[Any]:
        """Runs the program and waits for it; `staged`: the packed groups, already in JAX."""
        # Loops, not comprehensions: each comprehension is a Python call, on every call.
        crossing = []
        if staged is None:
            for group in self._groups:
                members = []
                for i in group:
                    members.append(tensors[i])
                crossing.append(torch_compat.flatten_dense_tensors(members))
        if self._device is None:
            for i in self._singles:
                crossing.append(tensors[i])
        else:
            dense = self._dense
            for k, i in enumerate(self._singles):
                tensor = tensors[i]
                if not tensor.is_contiguous():
                    # Row-major on the host first (the input is copied to the device anyway):
                    # shared in its own layout, a permuted tensor became an array that jaxlib
                    # 0.10.2 computed on wrongly once put on another device.
                    tensor = tensor.detach().contiguous()
                if i in dense:
                    shape = self._in_avals[i][0]
                    if tensor.shape != shape:
                        raise ValueError(
                            f"{self._single_names[k]}: expected a tensor "
                            f"of shape {shape}, got {tuple(tensor.shape)}. Fix: pass the "
                            f"tensors the runner was made for."
                        )
                    tensor = tensor.detach().view(dense[i])
                crossing.append(tensor)
        if staged is None:
            arrays = jit_arguments(crossing, names=self._crossing_names)
        elif crossing:
            arrays = [*staged.arrays, *jit_arguments(crossing, names=self._single_names)]
        else:
            arrays = staged.arrays
        if self._replicated is not None:
            arrays = jax.device_put(arrays, self._replicated)
        elif self._device is not None:
            arrays = jax.device_put(arrays, self._device)
            if self._dense_out is None:  # Before the program is traced: it reshapes them.
                self._dense_out = self._dense_outputs(arrays, carried)
        if self._compiled_at != self._clears.count:
            self._compiled_at = self._clears.count
            self._folder = _disk.directory()
            self._programs = {}
        if self._folder is None:
            run = self._jit
        else:
            # The layouts that are not row-major: of arrays imported from permuted tensors
            # (numpy views, staged buffers and 1-D arrays are row-major).
            layouts: tuple[Any, ...] = ()
            for index, array in enumerate(arrays):
                if type(array) is not np.ndarray and array.ndim > 1:
                    # jaxlib's arrays have `format`; jax's stub of `jax.Array` does not declare it.
                    order = cast(Any, array).format.layout.major_to_minor
                    if order != tuple(range(len(order))):
                        layouts = (*layouts, (index, order))
            run = self._programs.get(layouts)
            if run is None:
                # Lowered with what the call passed (the staged groups as the first call passed
                # them), so the program's name on disk matches.
                given = (
                    arrays if staged is None else [*staged.crossing, *arrays[len(self._groups) :]]
                )
                run = _disk.compiled(self._jit, [*given, *carried], self._options, self._folder)
                self._programs[layouts] = run
        outputs = run(*arrays, *carried)
        if self._host is not None:
            # Every exported output's copy to the host is queued behind the program now:
            # fetched one after another, each would wait a round trip to the device of its own
            # (0.35 ms on a v5e; docs/tpu.md).
            for output in outputs[: self._n_exported]:
                output.copy_to_host_async()
        if outputs:
            # JAX dispatch is asynchronous and the inputs alias torch memory (or the staging
            # buffers): the caller may write to them as soon as we return. All outputs of one
            # execution complete together.
            self._wait(outputs[0])
        return outputs

    def _wait(self, output: jax.Array) -> None:
        """Returns once `output` is computed: polls while this program is quick, else sleeps."""
        clock = time.perf_counter
        if self._poll:
            # Every concrete array has `is_ready` (jaxlib's ArrayImpl); jax's stub of
            # `jax.Array` does not declare it.
            is_ready = cast(_Pollable, output).is_ready
            deadline = clock() + _POLL_SECONDS
            while not is_ready():
                if clock() > deadline:
                    break
            else:
                return
        start = clock()
        output.block_until_ready()
        self._poll = clock() - start < _POLL_SECONDS
