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

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge_mr.dlpack import export_arrays, import_tensors

from ._avals import Aval

# Below this size a DLPack crossing (~10 µs of Python and runtime work per tensor) costs more
# than copying the tensor into a shared buffer, so small tensors of one dtype cross together.
_PACK_BYTES = 64 * 1024


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
    pack_from: int,
    mesh: Mesh | None,
) -> Runner:
    """The runner for tensors of `device_type` ("cpu", "cuda", "xla", ...).

    `in_avals` describe the tensor inputs. Exported outputs from index `pack_from` on (such as
    gradients) may come back as views of one shared buffer; earlier ones are separate tensors.
    A program that shards over a multi-device `mesh` gets its tensor inputs replicated over it
    and its exported outputs gathered (torch sees one device).
    """
    if device_type == "xla":
        return _XlaRunner(program, n_exported)
    return _DlpackRunner(program, in_avals, n_exported, pack_from, mesh)


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
        self,
        program: Program,
        in_avals: Sequence[Aval],
        n_exported: int,
        pack_from: int,
        mesh: Mesh | None,
    ) -> None:
        self._program = program
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._in_avals = list(in_avals)
        self._in_groups, self._in_singles = _pack_groups(in_avals)
        self._n_exported = n_exported
        self._pack_from = pack_from
        self._out_groups: tuple[tuple[int, ...], ...] = ()
        self._out_singles: tuple[int, ...] = ()
        self._out_templates: list[torch.Tensor] = []
        self._n_buffers = n_exported
        self._packed = jax.jit(self._packed_program)

    def _packed_program(self, *flat: jax.Array) -> list[jax.Array]:
        n_in = len(self._in_groups) + len(self._in_singles)
        arrays: list[Any] = [None] * len(self._in_avals)
        for group, buffer in zip(self._in_groups, flat, strict=False):
            offset = 0
            for i in group:
                shape, _ = self._in_avals[i]
                size = math.prod(shape)
                arrays[i] = buffer[offset : offset + size].reshape(shape)
                offset += size
        for i, array in zip(self._in_singles, flat[len(self._in_groups) : n_in], strict=True):
            arrays[i] = array
        outputs = self._program(*arrays, *flat[n_in:])
        if self._replicated is not None:
            exported = [jax.device_put(o, self._replicated) for o in outputs[: self._n_exported]]
            outputs = [*exported, *outputs[self._n_exported :]]
        head, tail = outputs[: self._pack_from], outputs[self._pack_from : self._n_exported]
        groups, singles = _pack_groups([(o.shape, np.dtype(o.dtype)) for o in tail])
        self._out_groups, self._out_singles = groups, singles
        self._out_templates = [torch.empty(o.shape, device="meta") for o in tail]
        self._n_buffers = len(head) + len(groups) + len(singles)
        packed = [jnp.concatenate([tail[i].ravel() for i in group]) for group in groups]
        return [*head, *packed, *(tail[i] for i in singles), *outputs[self._n_exported :]]

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        crossing = [
            torch._utils._flatten_dense_tensors([tensors[i] for i in group])
            for group in self._in_groups
        ]
        crossing += [tensors[i] for i in self._in_singles]
        arrays = import_tensors(crossing)
        if self._replicated is not None:
            arrays = jax.device_put(arrays, self._replicated)
        outputs = self._packed(*arrays, *carried)
        if outputs:
            # JAX dispatch is asynchronous and the inputs alias torch memory: the caller may
            # write to them as soon as we return. All outputs of one execution complete together.
            outputs[0].block_until_ready()
        n = self._n_buffers
        exported = export_arrays(outputs[:n])
        if not self._out_groups:
            return exported, outputs[n:]
        head = exported[: self._pack_from]
        tail: list[Any] = [None] * len(self._out_templates)
        buffers = iter(exported[self._pack_from :])
        for group, buffer in zip(self._out_groups, buffers, strict=False):
            views = torch._utils._unflatten_dense_tensors(
                buffer, [self._out_templates[i] for i in group]
            )
            for i, view in zip(group, views, strict=True):
                tail[i] = view
        for i, tensor in zip(self._out_singles, buffers, strict=True):
            tail[i] = tensor
        return [*head, *tail], outputs[n:]


class _XlaRunner:
    """Embeds the program in torch-xla's lazy graph; carried values are XLA tensors."""

    def __init__(self, program: Program, n_exported: int) -> None:
        try:
            from ._xla_backend import call_jax_on_xla
        except ImportError as err:
            raise ImportError(
                "bridge_mr got torch-xla tensors but cannot load its torch-xla backend "
                f"({err}). Install it with: pip install torch==2.9.0 torch_xla==2.9.0 flax"
            ) from err
        self._call: Callable[[Program, Sequence[Any]], list[torch.Tensor]] = call_jax_on_xla
        self._program = program
        self._n_exported = n_exported

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        outputs = self._call(self._program, [*tensors, *carried])
        n = self._n_exported
        return list(outputs[:n]), list(outputs[n:])
