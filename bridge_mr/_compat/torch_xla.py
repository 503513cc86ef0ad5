"""torch_xla's modules, imported on first use, including the private `jax_workarounds`.

Checked on torch_xla 2.9.0 with torch 2.9.0. Importing this module never imports torch_xla:
`import_torch_xla` does, on its first call (when XLA tensors exist).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ._lazy import import_modules

__all__ = ["INSTALL_HINT", "TorchXla", "import_torch_xla"]

#: How to install the torch-xla backend's dependencies (torch_xla 2.9.0 pins torch 2.9.0).
INSTALL_HINT = "pip install torch==2.9.0 torch_xla==2.9.0"


class TorchXla(NamedTuple):
    """The torch_xla modules bridge_mr's torch-xla runner uses.

    Attributes:
      builder: `torch_xla.core.xla_builder` (HLO module protos as torch-xla computations).
      workarounds: `torch_xla._internal.jax_workarounds` (private: `jax_import_guard`,
        `jax_env_context`, the guards torch-xla's own `call_jax` uses). torch_xla 2.9.0.
      runtime: `torch_xla.runtime`.
      spmd: `torch_xla.distributed.spmd`.
    """

    builder: Any
    workarounds: Any
    runtime: Any
    spmd: Any


@functools.cache
def import_torch_xla() -> TorchXla:
    """Imports the torch_xla modules bridge_mr uses (once; later calls return the same tuple).

    Returns:
      The modules, as a `TorchXla`.

    Raises:
      ImportError: torch_xla is not importable; the message says how to install it.
    """
    workarounds, builder, spmd, runtime = import_modules(
        (
            "torch_xla._internal.jax_workarounds",
            "torch_xla.core.xla_builder",
            "torch_xla.distributed.spmd",
            "torch_xla.runtime",
        ),
        f"bridge_mr's torch-xla backend needs torch_xla, which is not importable ({{error}}). "
        f"Install it with `{INSTALL_HINT}` (torch_xla 2.9.0 requires torch 2.9.0 exactly).",
    )
    return TorchXla(builder, workarounds, runtime, spmd)
