"""Runners: where a traced program runs, chosen once per call signature by the tensors' device.

* `DlpackRunner` (CPU and CUDA tensors): zero-copy import through `bridge_mr.dlpack`, one
  compiled execution, a wait for its results (the inputs alias torch memory), zero-copy export.
* `XlaRunner` (torch-xla tensors): the program lowered once to HLO and embedded in torch-xla's
  lazy graph, so it compiles together with the surrounding torch ops (no DLPack, no host trip).
* `TorchTpuRunner` (TorchTPU's "tpu" tensors, `_torch_tpu.py`): the program exported once for
  the TPU and run by TorchTPU on the tensors (JAX on the CPU there: trace and export only).

A program is traced under `trace_context(device_type)` and run by `runner_for(device_type,
...)`; the two agree on the JAX context (on torch-xla: its SPMD mesh and GSPMD partitioning).
`call_jax_on_xla` is the torch-xla runner as a plain function of a JAX function.
"""

from ._choose import runner_for as runner_for
from ._choose import trace_context as trace_context
from ._dlpack import DlpackRunner as DlpackRunner
from ._protocols import Jitted as Jitted
from ._protocols import Runner as Runner
from ._xla import XlaRunner as XlaRunner
from ._xla import call_jax_on_xla as call_jax_on_xla
from ._xla import is_xla_tensor as is_xla_tensor
from ._xla import torch_xla_global_mesh as torch_xla_global_mesh

__all__ = [
    "DlpackRunner",
    "Jitted",
    "Runner",
    "XlaRunner",
    "call_jax_on_xla",
    "is_xla_tensor",
    "runner_for",
    "torch_xla_global_mesh",
    "trace_context",
]
