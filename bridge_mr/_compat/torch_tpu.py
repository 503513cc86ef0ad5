"""TorchTPU's kernel calls: a serialized StableHLO program run on torch "tpu" tensors.

`torch_tpu` (TorchTPU, device "tpu") runs a JAX program on its tensors through
`torch.tpu.pallas.jax_op`, which exports the program with `jax.export` and hands the serialized
module to private entry points of `torch_tpu._internal.pallas.tpu_torch_pallas`:
`register_custom_kernel` (compiled on first call, kept by name and fingerprint),
`lookup_custom_kernel` and `call_custom_kernel` (inputs, output placeholders, results as new
"tpu" tensors). bridge_mr calls them directly: its programs are flat lists of arrays already
exported per signature, and `jax_op` would register a process-wide torch op per program. The
XLA options a kernel compiles with are pushed and popped around its calls with
`compiler_options_impl`, the calls behind `torch.tpu.compiler.custom_compiler_options` (which
warns once per process that it is experimental).

Checked on torch_tpu 0.2.0 with torch 2.13.0 and libtpu 0.0.51 (`TESTED`); another version is
refused with the versions to install. Importing this module imports neither torch_tpu nor JAX;
`kernels()` imports torch_tpu's module on its first call (when "tpu" tensors exist).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, NamedTuple

from ._lazy import import_modules

__all__ = ["TESTED", "Kernels", "kernels"]

#: The torch_tpu releases whose private kernel calls bridge_mr was checked on.
TESTED = ("0.2.0",)


class Kernels(NamedTuple):
    """TorchTPU's private kernel calls (torch_tpu 0.2.0).

    Attributes:
      register: `register_custom_kernel(name, fingerprint, serialized_mlir_module=bytes)`.
      call: `call_custom_kernel(name, fingerprint, inputs=, output_shapes=, donate_argnums=,
        device_assignment=)`, returning one new tensor per output placeholder.
      lookup: `lookup_custom_kernel(name, fingerprint)`, whether that kernel is registered.
      version: the installed torch_tpu's version.
      push_options: `push_compiler_options(options)`: XLA options (a dict of strings) for what
        compiles until the matching `pop_options()`, merged over those pushed before.
      pop_options: `pop_compiler_options()`.
    """

    register: Any
    call: Any
    lookup: Any
    version: str
    push_options: Any
    pop_options: Any


@functools.cache
def kernels() -> Kernels:
    """TorchTPU's kernel calls (imported once; later calls return the same tuple).

    Returns:
      The calls, as `Kernels`.

    Raises:
      ImportError: torch_tpu is not importable, or its version is not one of `TESTED`; the
        message says what to install.
    """
    try:
        version = importlib.metadata.version("torch_tpu")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    if version not in TESTED:
        raise ImportError(
            f"bridge_mr runs TorchTPU tensors with torch_tpu {' or '.join(TESTED)} (its private "
            f"kernel calls change between releases), found torch_tpu {version}. Install "
            f"`pip install torch_tpu=={TESTED[-1]} libtpu==0.0.51`, or move the tensors to the "
            "CPU (`.cpu()`), where bridge_mr runs their programs on JAX's default device."
        )
    pallas, options = import_modules(
        (
            "torch_tpu._internal.pallas.tpu_torch_pallas",
            "torch_tpu._internal.compiler_options.compiler_options_impl",
        ),
        f"bridge_mr could not import TorchTPU's kernel calls ({{error}}) from torch_tpu {version}.",
    )
    return Kernels(
        pallas.register_custom_kernel,
        pallas.call_custom_kernel,
        pallas.lookup_custom_kernel,
        version,
        options.push_compiler_options,
        options.pop_compiler_options,
    )
