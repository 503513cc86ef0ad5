"""Functions written in torch, run as JAX functions: `from_torch` (torchax underneath).

Importing this package imports torch and jax, not torchax: torchax is imported, and its
version checked, on the first call of a converted function.
"""

from ._convert import client_keys as client_keys
from ._convert import from_torch as from_torch
from ._environment import UnsupportedTorchOperation as UnsupportedTorchOperation

__all__ = ["UnsupportedTorchOperation", "client_keys", "from_torch"]
