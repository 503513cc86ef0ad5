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

    return bool(torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python))
