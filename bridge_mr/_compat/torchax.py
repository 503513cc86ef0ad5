"""torchax, the engine of `bridge_mr.from_torch`, imported on first use and version-checked.

Checked on torchax 0.0.14.dev20261026 with torch 2.9.0 and 2.13.0 and jax 0.10.2 (its stable
0.0.13 fails at import on torch >= 2.13). Importing this module never imports torchax:
`import_torchax` does, on its first call. Importing torchax has process-wide effects that
bridge_mr cannot avoid: it turns off torch's fast path for `nn.MultiheadAttention`
(`torch.backends.mha.set_fastpath_enabled(False)`) and registers torch's "jax" device.

Importing torchax also registers "jax" as torch's PrivateUse1 device, with a device module that
says it is available; torch then takes it for the process's accelerator, and `torch.compile`
fails on every call ("PyTorch is not linked with support for jax devices", when dynamo asks
`torch.accelerator` for the current stream). `import_torchax` makes that module say it is not
available: torchax itself never asks, and its tensors need no torch device support.

Private entries: `Tensor._elem` (the JAX value a torchax tensor holds) is read and written
through `value_of` and `rebind`, the way torchax's own in-place ops write it.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

from ._lazy import import_modules

__all__ = ["INSTALL_HINT", "PINNED", "Torchax", "import_torchax", "rebind", "value_of"]

#: The torchax release bridge_mr is tested with (an exact pin: torchax has no stable release
#: for torch >= 2.13 yet).
PINNED = "0.0.14.dev20261026"

#: How to install it.
INSTALL_HINT = f"pip install torchax=={PINNED}  (or: pip install 'bridge_mr[from_torch]')"


class Torchax(NamedTuple):
    """The torchax names bridge_mr uses.

    Attributes:
      version: `torchax.__version__`.
      directory: the directory of the torchax package.
      Environment: `torchax.tensor.Environment` (an op registry, a PRNG key, torch modes).
      Tensor: `torchax.tensor.Tensor`, a torch tensor holding a JAX value.
      View: `torchax.view.View`, a lazy view of a `Tensor`.
      OperatorNotFound: raised by `Environment.dispatch` for an op with no JAX lowering.
    """

    version: str
    directory: str
    Environment: Any
    Tensor: Any
    View: Any
    OperatorNotFound: type[Exception]


@functools.cache
def import_torchax() -> Torchax:
    """Imports torchax (once; later calls return the same tuple) and checks its version.

    Returns:
      The names, as a `Torchax`.

    Raises:
      ImportError: torchax is not importable, or is another version than `PINNED`; the message
        says how to install the pinned one.
    """
    torchax, tensor, view = import_modules(
        ("torchax", "torchax.tensor", "torchax.view"),
        f"bridge_mr.from_torch runs torch code through torchax, which is not importable "
        f"({{error}}). Install it with `{INSTALL_HINT}`.",
    )
    version = str(getattr(torchax, "__version__", "unknown"))
    device_module = getattr(torchax, "device_module", None)
    if device_module is not None:
        device_module.is_available = _not_available
    if version != PINNED:
        raise ImportError(
            f"bridge_mr.from_torch is tested with torchax {PINNED} only; torchax {version} is "
            f"installed (other releases lower some ops differently or fail on this torch). "
            f"Install the tested one with `{INSTALL_HINT}`."
        )
    return Torchax(
        version,
        os.path.dirname(torchax.__file__ or ""),
        tensor.Environment,
        tensor.Tensor,
        view.View,
        tensor.OperatorNotFound,
    )


def _not_available() -> bool:
    """torchax's "jax" device, as torch.accelerator should see it (see the module docstring)."""
    return False


def value_of(tensor: Any) -> Any:
    """The JAX value a torchax `Tensor` holds."""
    return tensor._elem


def rebind(tensor: Any, value: Any) -> None:
    """Makes the torchax `Tensor` hold `value` (an in-place update, as torchax's own do)."""
    tensor._elem = value
