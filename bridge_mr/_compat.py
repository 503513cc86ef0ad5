"""Private names of jax and torch that bridge_mr relies on, each behind one accessor.

Each entry says which versions it was checked on; the tests assert the path taken there.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from jax._src import config as _jax_config  # jax 0.7 - 0.10: trace_context()


def jax_trace_context() -> Hashable:
    """What of JAX's configuration a trace depends on (x64, promotion, precision, ...).

    `jax.jit` keys its own trace cache with this value, so a cache keyed with it never reuses a
    trace that jit would redo after a `jax.config.update` or a config context manager.
    """
    return _jax_config.trace_context()


def dispatches_to_python(tensor: Any) -> bool:
    """Whether a torch tensor is a `__torch_dispatch__` subclass (e.g. a wrapper subclass).

    Such a tensor's ops run Python code, and its storage need not hold its values (a wrapper
    has none): neither numpy nor DLPack may read its memory. torch 2.9 - 2.13.
    """
    import torch

    if type(tensor) is torch.Tensor:  # The common case, without the dispatcher query.
        return False
    return bool(torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python))


def graph_break_resumes() -> bool:
    """Whether Dynamo resumes after `torch._dynamo.graph_break()` (checked on torch 2.13).

    After such a break torch 2.9 runs the rest of the frame outside Dynamo but still traces its
    callees, so a `torch.compiler.disable`d call that follows is traced (and fails) there.
    """
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


def forward_ad_active() -> bool:
    """Whether a `torch.autograd.forward_ad.dual_level` is open (dual tensors may exist).

    Read from the module's level counter, which `dual_level` maintains. torch 2.9 - 2.13.
    """
    import torch.autograd.forward_ad as forward_ad

    return forward_ad._current_level >= 0
