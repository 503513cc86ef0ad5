"""torchax, the engine of `bridge_mr.from_torch`, imported on first use, version-checked, quietly.

Checked on torchax 0.0.14.dev20261026 with torch 2.9.0 and 2.13.0 and jax 0.10.2 (its stable
0.0.13 fails at import on torch >= 2.13). Importing this module never imports torchax:
`import_torchax` does, on its first call.

Importing torchax changes process-wide state of torch and JAX (pytorch/xla issue 9730): it
renames torch's PrivateUse1 backend to "jax" and registers a `torch.jax` device module that says
it is available, so torch takes "jax" for the process's accelerator (`torch.accelerator`), the
CUDA autograd engine asks it for streams ("PyTorch is not linked with support for jax devices"
on every backward after it) and `torch.compile` fails; it turns off torch's fast path for
`nn.MultiheadAttention`, sets `ENABLE_RUNTIME_UPTIME_TELEMETRY` in `os.environ`, may set
`jax_pjrt_client_create_options`, and adds its decompositions to torch's global decomposition
table (when its first `Environment` loads its ops). None of it is needed by the op lowerings
bridge_mr uses, so `import_torchax` imports torchax with the first two calls stubbed out and the
rest put back as they were: afterwards torch and JAX are as the user left them. torchax's
tensors then report the device they are on in torch, "meta" (see `device`).

If torchax was imported before (by the user, who then asked for its registration), it is used
as it is and nothing is undone. The quiet import is for the whole process: a later `import
torchax` gets the module without its registration (`torch.device("jax")` does not parse then);
import torchax before bridge_mr's first `from_torch` call to have it.

Private entries: `Tensor._elem` (the JAX value a torchax tensor holds) is read and written
through `value_of` and `rebind`, the way torchax's own in-place ops write it;
`torch._C._get_privateuse1_backend_name` and `torch._decomp.global_decomposition_table`
(torch 2.9 - 2.13); `Environment._should_use_torchax_tensor` (`own_every_factory`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

from ._lazy import import_modules

__all__ = [
    "INSTALL_HINT",
    "PINNED",
    "Torchax",
    "device",
    "import_torchax",
    "own_every_factory",
    "rebind",
    "value_of",
]

#: The torchax release bridge_mr is tested with (an exact pin: torchax has no stable release
#: for torch >= 2.13 yet).
PINNED = "0.0.14.dev20261026"

#: How to install it.
INSTALL_HINT = f"pip install torchax=={PINNED}  (or: pip install 'bridge_mr[from_torch]')"

#: torchax's modules bridge_mr uses, and the one its first `Environment` imports that registers
#: decompositions in torch's global table, imported inside the quiet import (which puts them
#: back).
_MODULES = ("torchax.tensor", "torchax.view", "torchax.decompositions")

#: The PrivateUse1 backend's name torchax's own import gives it.
_REGISTERED = "jax"

_TELEMETRY = "ENABLE_RUNTIME_UPTIME_TELEMETRY"
_CLIENT_OPTIONS = "jax_pjrt_client_create_options"


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

    torch's and JAX's process-wide state is as before (see the module docstring).

    Returns:
      The names, as a `Torchax`.

    Raises:
      ImportError: torchax is not importable, or is another version than `PINNED`; the message
        says how to install the pinned one.
    """
    failure = (
        f"bridge_mr.from_torch runs torch code through torchax, which is not importable "
        f"({{error}}). Install it with `{INSTALL_HINT}`."
    )
    with _quietly(already="torchax" in sys.modules):
        (torchax,) = import_modules(("torchax",), failure)
        version = str(getattr(torchax, "__version__", "unknown"))
        if version != PINNED:
            raise ImportError(
                f"bridge_mr.from_torch is tested with torchax {PINNED} only; torchax {version} "
                f"is installed (other releases lower some ops differently or fail on this "
                f"torch). Install the tested one with `{INSTALL_HINT}`."
            )
        tensor, view, *_ = import_modules(_MODULES, failure)
    _report_own_device(tensor.Tensor)
    _report_own_device(view.View)
    return Torchax(
        version,
        os.path.dirname(torchax.__file__ or ""),
        tensor.Environment,
        tensor.Tensor,
        view.View,
        tensor.OperatorNotFound,
    )


@contextlib.contextmanager
def _quietly(*, already: bool) -> Iterator[None]:
    """torchax's import, its process-wide registrations stubbed out or put back afterwards.

    Args:
      already: torchax's `__init__` already ran (its registrations, if any, are the user's).
    """
    import jax
    import torch
    import torch._decomp

    tables = torch._decomp.global_decomposition_table
    saved_tables = {kind: dict(table) for kind, table in tables.items()}
    telemetry = os.environ.get(_TELEMETRY)
    options = getattr(jax.config, _CLIENT_OPTIONS, None)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    stubs = [
        (torch.utils, "rename_privateuse1_backend"),
        (torch, "_register_device_module"),
        (torch.backends.mha, "set_fastpath_enabled"),
    ]
    saved_calls = [getattr(owner, name) for owner, name in stubs]
    if not already:
        for owner, name in stubs:
            setattr(owner, name, _ignore)
    try:
        yield
    finally:
        for (owner, name), call in zip(stubs, saved_calls, strict=True):
            setattr(owner, name, call)
        for kind, table in tables.items():
            table.clear()
            table.update(saved_tables.get(kind, {}))
        if not already:
            torch.backends.mha.set_fastpath_enabled(fastpath)
            if telemetry is None:
                os.environ.pop(_TELEMETRY, None)
            else:
                os.environ[_TELEMETRY] = telemetry
            if getattr(jax.config, _CLIENT_OPTIONS, None) != options:
                jax.config.update(_CLIENT_OPTIONS, options)


def _ignore(*args: Any) -> None:
    """What torchax's process-wide registration calls do during the quiet import."""
    del args


def _report_own_device(cls: type) -> None:
    """Makes torchax's tensors report a device torch can parse without torchax's registration.

    torchax's `device` property returns `torch.device("jax:0")`, which parses only once the
    PrivateUse1 backend is named "jax"; otherwise they report `device()`.
    """

    def reported(self: Any) -> Any:
        del self
        return device()

    cls.device = property(reported)


def device() -> Any:
    """The torch device torchax's tensors are on, as torch code inside `from_torch` sees it.

    "jax" where torchax was imported with its registration. Otherwise "meta", the device torch
    itself holds them on (torchax makes them as meta wrapper subclasses): torchax's factories
    and `.to` take "meta" for their own device inside its environment, and unlike the unnamed
    PrivateUse1 backend it needs no device module (torch imports `torch.<backend name>` to
    initialize a PrivateUse1 device, and "torch.privateuseone" does not exist).
    """
    import torch

    if torch._C._get_privateuse1_backend_name() == _REGISTERED:
        return torch.device(_REGISTERED, 0)
    return torch.device("meta")


def own_every_factory(env: Any) -> None:
    """Makes `env` hand out a torchax tensor from every torch factory, whatever device it names.

    torchax decides by the device (`Environment._should_use_torchax_tensor`): "cpu" stays
    torch's, and "meta" is its own only while `env.enabled`, a flag its nested dispatch clears
    on exit while the outer modes are still on.
    """
    env._should_use_torchax_tensor = _always


def _always(device: Any) -> bool:
    del device
    return True


def value_of(tensor: Any) -> Any:
    """The JAX value a torchax `Tensor` holds."""
    return tensor._elem


def rebind(tensor: Any, value: Any) -> None:
    """Makes the torchax `Tensor` hold `value` (an in-place update, as torchax's own do)."""
    tensor._elem = value
