"""The process runner: this rank's tensors become its part of global arrays, one program runs
over every process's devices, and each rank gets back its part of the results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import torch

from bridge_mr import distributed
from bridge_mr._dtypes import Aval
from bridge_mr.dlpack import export_arrays, jit_arguments

from ._protocols import Jitted


class ProcessRunner:
    """Runs a program traced on global shapes with this rank's local tensors.

    A per-rank tensor holds this rank's rows of the clients axis (`layout.slot` of them); any
    other tensor is this rank's copy of a value every rank holds alike. Exported per-rank
    outputs (gradients of per-rank inputs) come back as this rank's rows; the others as this
    rank's replica. Carried values (VJP residuals) stay global arrays.

    Args:
      jitted: the jitted program over global arrays: the tensors, then the carried values.
      in_avals: global shapes and dtypes of the tensor inputs.
      n_exported: how many leading outputs come back as torch tensors.
      layout: the agreed layout of the ranks' clients.
      in_per_rank: for each tensor input, whether it is per-rank.
      out_per_rank: for each exported output, whether it is per-rank.
      compiler_options: XLA options to compile with.
      names: what error messages call each tensor input.
    """

    def __init__(
        self,
        jitted: Jitted,
        in_avals: Sequence[Aval],
        n_exported: int,
        layout: distributed.Layout,
        in_per_rank: Sequence[bool],
        out_per_rank: Sequence[bool],
        compiler_options: Mapping[str, str] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(in_per_rank) != len(in_avals) or len(out_per_rank) != n_exported:
            raise ValueError(
                f"ProcessRunner: expected one per-rank flag per input ({len(in_avals)}) and per "
                f"exported output ({n_exported}); got {len(in_per_rank)} and {len(out_per_rank)}."
            )
        self._jitted = jitted
        self._layout = layout
        self._in_per_rank = tuple(in_per_rank)
        self._out_per_rank = tuple(out_per_rank)
        self._n_exported = n_exported
        self._names = list(names) if names is not None else None
        options = dict(compiler_options) if compiler_options else None
        self._run = jax.jit(self._constrained, compiler_options=options)

    def _constrained(self, *flat: jax.Array) -> list[jax.Array]:
        outputs = self._jitted(*flat)
        n = self._n_exported
        exported = [
            distributed.constrain(o, self._layout, per_rank=p)
            for o, p in zip(outputs[:n], self._out_per_rank, strict=True)
        ]
        return [*exported, *outputs[n:]]

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        local = jit_arguments(tensors, names=self._names)
        arrays = [
            distributed.global_array(a, self._layout, per_rank=p)
            for a, p in zip(local, self._in_per_rank, strict=True)
        ]
        outputs = self._run(*arrays, *carried)
        if outputs:
            # The inputs may alias torch memory, which the caller may write once we return.
            outputs[0].block_until_ready()
        n = self._n_exported
        parts = [
            distributed.local_part(o, per_rank=p)
            for o, p in zip(outputs[:n], self._out_per_rank, strict=True)
        ]
        return export_arrays(parts), outputs[n:]
