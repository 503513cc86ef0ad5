"""One choice per call signature: the runner for a device type, and its tracing context."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from bridge_mr import distributed
from bridge_mr._dtypes import Aval

from . import _dlpack, _processes, _torch_tpu, _xla
from ._protocols import Jitted, Runner


def runner_for(
    device_type: str,
    jitted: Jitted,
    in_avals: Sequence[Aval],
    n_exported: int,
    mesh: Mesh | None,
    carried_avals: Sequence[Aval] = (),
    compiler_options: Mapping[str, str] | None = None,
    names: Sequence[str] | None = None,
    layout: distributed.Layout | None = None,
    in_per_rank: Sequence[bool] = (),
    out_per_rank: Sequence[bool] = (),
    device: Any = None,
) -> Runner:
    """The runner of `program` for tensors of `device_type` ("cpu", "cuda", "xla" or "tpu").

    Args:
      device_type: the device type of the call's tensors.
      jitted: the jitted program, traced under `trace_context(device_type)`.
      in_avals: shapes and dtypes of its tensor inputs.
      n_exported: how many leading outputs come back as torch tensors; the rest are carried.
      mesh: a multi-device mesh the program shards over (DLPack runner: inputs replicated
        over it, outputs gathered); None otherwise. The torch-xla runner takes its mesh from
        the trace context instead.
      carried_avals: shapes and dtypes of the carried inputs that follow the tensors.
      compiler_options: XLA options to compile `jitted` with (CPU and CUDA; `jitted` itself
        jitted without any: jax.jit takes them at the top level only).
      names: what error messages call each tensor input, e.g. for an int64 tensor given for
        an int32 input (x64 off) that holds a value out of int32's range; default
        `tensors[i]`.
      layout: across several processes: the agreed layout of the ranks' clients. The program
        is then traced on global shapes (`in_avals`) and runs over every process's devices.
      in_per_rank: with `layout`, for each tensor input, whether it holds this rank's clients.
      out_per_rank: with `layout`, for each exported output, whether it is per-rank.
      device: for CPU tensors, the JAX device the program runs on when that is not the CPU
        (`bridge_mr.dlpack.host_program_device()`): inputs go there, outputs come back.

    Returns:
      A callable `(tensors, carried) -> (exported tensors, carried values)`.

    Example:
      >>> f32 = np.dtype("float32")
      >>> run = runner_for("cpu", jax.jit(lambda x: [x + 1]), [((3,), f32)], 1, None)
      >>> (y,), carried = run([torch.zeros(3)], [])
    """
    if device_type == "tpu" and (layout is not None or mesh is not None):
        raise NotImplementedError(
            "bridge_mr: TorchTPU tensors run a round on one chip, without a JAX mesh or several "
            "processes (TorchTPU holds the chip; JAX here only traces). Drop the mesh / layout, "
            "or run the round on CPU tensors with JAX holding the chips (JAX_PLATFORMS unset): "
            "bridge_mr then runs it on JAX's default device or over the mesh's devices."
        )
    if layout is not None:
        if device_type == "xla":
            raise NotImplementedError(
                "bridge_mr: map_reduce across processes runs on CPU and CUDA tensors; on "
                "torch-xla, use torch-xla's own multi-host SPMD (see docs/torch_xla.md's "
                "multi-host recipe)."
            )
        return _processes.ProcessRunner(
            jitted,
            in_avals,
            n_exported,
            layout,
            in_per_rank,
            out_per_rank,
            compiler_options,
            names,
        )
    if device_type == "xla":
        return _xla.XlaRunner(jitted, [*in_avals, *carried_avals], n_exported, names)
    if device_type == "tpu":
        return _torch_tpu.TorchTpuRunner(jitted, [*in_avals, *carried_avals], n_exported, names)
    return _dlpack.DlpackRunner(jitted, in_avals, n_exported, mesh, compiler_options, names, device)


def trace_context(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The JAX context to trace a program for `device_type` in; its runner lowers in the same.

    On torch-xla: torch-xla's global SPMD mesh as an Auto abstract mesh (unless the caller set
    a JAX mesh) and GSPMD partitioning. On TorchTPU: programs for the TPU
    (`jax_core.programs_for`), JAX itself on the CPU. On CPU and CUDA: the caller's context.
    """
    if device_type == "xla":
        return _xla.trace_context()
    if device_type == "tpu":
        return _torch_tpu.trace_context()
    return _dlpack.trace_context()
