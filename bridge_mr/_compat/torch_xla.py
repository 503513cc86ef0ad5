"""torch_xla's modules, imported on first use, including the private `jax_workarounds`.

Checked on torch_xla 2.9.0 with torch 2.9.0. Importing this module never imports torch_xla:
`import_torch_xla` does, on its first call (when XLA tensors exist).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

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


_TORCH_XLA: list[TorchXla] = []  # the first successful import, once made


def import_torch_xla() -> TorchXla:
    """Imports the torch_xla modules bridge_mr uses (once; later calls return the same tuple).

    Returns:
      The modules, as a `TorchXla`.

    Raises:
      ImportError: torch_xla is not importable; the message says how to install it.
    """
    if _TORCH_XLA:
        return _TORCH_XLA[0]
    # By name: torch_xla is installed in the torch-xla environment only, so the type checker
    # (run in the main one) cannot resolve it.
    try:
        workarounds = importlib.import_module("torch_xla._internal.jax_workarounds")
        builder = importlib.import_module("torch_xla.core.xla_builder")
        spmd = importlib.import_module("torch_xla.distributed.spmd")
        runtime = importlib.import_module("torch_xla.runtime")
    except ImportError as error:
        raise ImportError(
            f"bridge_mr's torch-xla backend needs torch_xla, which is not importable ({error}). "
            f"Install it with `{INSTALL_HINT}` (torch_xla 2.9.0 requires torch 2.9.0 exactly)."
        ) from error
    _TORCH_XLA.append(TorchXla(builder, workarounds, runtime, spmd))
    return _TORCH_XLA[0]
