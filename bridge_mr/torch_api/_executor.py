"""Where a traced program runs: via DLPack for CPU and CUDA tensors, in torch-xla's graph for XLA.

A *program* is a jitted JAX function over a flat list of arrays that returns a flat list of
arrays. Its inputs are torch tensors followed by *carried* values (results of an earlier program
on the same kind of runner, such as VJP residuals, which stay on the executor's side); its first
`n_exported` outputs come back as torch tensors and the rest stay carried.

The seam for torch-xla: `runner_for("xla", ...)` calls
`bridge_mr.torch_api._xla_backend.call_jax_on_xla(program, tensors) -> list[torch.Tensor]`,
which must run the jitted program on XLA tensors inside the lazy graph and return all of its
outputs as XLA tensors; carried values are then XLA tensors too.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge_mr._compat.torch import flatten_dense_tensors
from bridge_mr._dtypes import Aval
from bridge_mr.dlpack import export_arrays, jit_arguments

from ._xla_backend import call_jax_on_xla, lowering_mesh

# Below this size importing a tensor (3-10 µs of Python and runtime work each) costs more than
# copying it into a shared buffer, so small tensors of one dtype cross together. (Exports cost
# ~3 µs each, about what splitting a shared buffer into views costs: outputs are not packed.)
_PACK_BYTES = 64 * 1024


# Waking a thread that sleeps on a result takes tens of µs on a busy or virtualised machine, as
# long as a tiny program runs: results that come within this time are polled for instead.
_POLL_SECONDS = 100e-6


class Program(Protocol):
    """A jitted JAX function over flat arrays returning a flat list of arrays."""

    def __call__(self, *arrays: Any) -> list[jax.Array]: ...


class Runner(Protocol):
    """Runs one program: torch tensors and carried values in; torch tensors and carried out."""

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]: ...


def runner_for(
    device_type: str,
    program: Program,
    in_avals: Sequence[Aval],
    n_exported: int,
    mesh: Mesh | None,
) -> Runner:
    """The runner for tensors of `device_type` ("cpu", "cuda", "xla", ...).

    `in_avals` describe the tensor inputs. A program that shards over a multi-device `mesh`
    gets its tensor inputs replicated over it and its exported outputs gathered (torch sees
    one device).
    """
    if device_type == "xla":
        return _XlaRunner(program, n_exported)
    return _DlpackRunner(program, in_avals, n_exported, mesh)


def trace_context(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The JAX context to trace a program for `device_type` in: on XLA, the mesh it lowers under.

    So tracing and lowering see the same mesh (torch-xla's global SPMD mesh, see
    `_xla_backend.lowering_mesh`); on other devices it changes nothing.
    """
    mesh = lowering_mesh() if device_type == "xla" else None
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh)


def _pack_groups(avals: Sequence[Aval]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Groups of indices of small same-dtype values that share a buffer, and the rest."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, (shape, dtype) in enumerate(avals):
        if math.prod(shape) * dtype.itemsize <= _PACK_BYTES:
            by_dtype.setdefault(dtype, []).append(i)
    groups = tuple(tuple(ix) for ix in by_dtype.values() if len(ix) > 1)
    grouped = {i for group in groups for i in group}
    return groups, tuple(i for i in range(len(avals)) if i not in grouped)


class _DlpackRunner:
    """Imports tensors without copying (small ones packed per dtype), runs, exports."""

    def __init__(
        self, program: Program, in_avals: Sequence[Aval], n_exported: int, mesh: Mesh | None
    ) -> None:
        self._program = program
        self._in_avals = list(in_avals)
        self._groups, self._singles = _pack_groups(in_avals)
        self._n_exported = n_exported
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        wrap = self._groups or self._replicated is not None
        self._run = jax.jit(self._unpacking_program) if wrap else program
        self._poll = True

    def _unpacking_program(self, *flat: jax.Array) -> list[jax.Array]:
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
            arrays[i] = array
        outputs = self._program(*arrays, *flat[n_in:])
        if self._replicated is None:
            return outputs
        n = self._n_exported
        return [*(jax.device_put(o, self._replicated) for o in outputs[:n]), *outputs[n:]]

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        crossing = [flatten_dense_tensors([tensors[i] for i in group]) for group in self._groups]
        crossing += [tensors[i] for i in self._singles]
        arrays = jit_arguments(crossing)
        if self._replicated is not None:
            arrays = jax.device_put(arrays, self._replicated)
        outputs = self._run(*arrays, *carried)
        if outputs:
            # JAX dispatch is asynchronous and the inputs alias torch memory: the caller may
            # write to them as soon as we return. All outputs of one execution complete together.
            self._wait(outputs[0])
        n = self._n_exported
        # Fresh outputs that only this runner holds, and drops.
        return export_arrays(outputs[:n], sole_owner=True), outputs[n:]

    def _wait(self, output: jax.Array) -> None:
        """Returns once `output` is computed: polls while this program is quick, else sleeps."""
        clock = time.perf_counter
        if self._poll:
            deadline = clock() + _POLL_SECONDS
            while not output.is_ready():
                if clock() > deadline:
                    break
            else:
                return
        start = clock()
        output.block_until_ready()
        self._poll = clock() - start < _POLL_SECONDS


class _XlaRunner:
    """Embeds the program in torch-xla's lazy graph; carried values are XLA tensors."""

    def __init__(self, program: Program, n_exported: int) -> None:
        self._program = program
        self._n_exported = n_exported

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        outputs = call_jax_on_xla(self._program, [*tensors, *carried])
        n = self._n_exported
        return outputs[:n], outputs[n:]
