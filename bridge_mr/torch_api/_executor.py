"""Where a traced program runs: via DLPack for CPU and CUDA tensors, in torch-xla's graph for XLA.

A *program* is a jitted JAX function over a flat list of arrays that returns a flat list of
arrays. Its inputs are torch tensors followed by *carried* values (results of an earlier program
of the same runner kind, such as VJP residuals, that stay on the executor's side); its first
`n_exported` outputs come back as torch tensors and the rest stay carried.

The seam for torch-xla: `runner_for("xla", ...)` calls
`bridge_mr.torch_api._xla_backend.call_jax_on_xla(jitted, tensors) -> list[torch.Tensor]`,
which must run the jitted function on XLA tensors inside the lazy graph. There, carried values
are XLA tensors too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import torch

from bridge_mr.dlpack import export_arrays, import_tensors


class Program(Protocol):
    """A jitted JAX function over flat arrays returning a flat list of arrays."""

    def __call__(self, *arrays: Any) -> list[jax.Array]: ...


class Runner(Protocol):
    """Runs one program: torch tensors and carried values in; torch tensors and carried out."""

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]: ...


class _DlpackRunner:
    """Imports the tensors without copying, runs the jit, exports the first `n_exported` outputs."""

    __slots__ = ("_n_exported", "_program")

    def __init__(self, program: Program, n_exported: int) -> None:
        self._program = program
        self._n_exported = n_exported

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        outputs = self._program(*import_tensors(tensors), *carried)
        if outputs:
            # JAX dispatch is asynchronous and the inputs alias torch memory: the caller may
            # write to them as soon as we return. All outputs of one execution complete together.
            outputs[0].block_until_ready()
        n = self._n_exported
        return export_arrays(outputs[:n]), outputs[n:]


class _XlaRunner:
    """Embeds the program in torch-xla's lazy graph; carried values are XLA tensors."""

    __slots__ = ("_call", "_n_exported", "_program")

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


def runner_for(device_type: str, program: Program, n_exported: int) -> Runner:
    """The runner for tensors of `device_type` ("cpu", "cuda", "xla", ...)."""
    if device_type == "xla":
        return _XlaRunner(program, n_exported)
    return _DlpackRunner(program, n_exported)
