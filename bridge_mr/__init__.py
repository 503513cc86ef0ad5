"""bridge_mr: DrJAX-style MapReduce primitives as JAX primitives, callable from PyTorch.

The five MapReduce names accept torch tensors (differentiable, through the bridge) and JAX
values (the `bridge_mr.jax_core` functions themselves). `bridge_mr.jax_core` is the plain-JAX
layer; `bridge_mr.dlpack` the tensor exchange.
"""

from . import dlpack as dlpack
from . import jax_core as jax_core
from .jax_core import Placement as Placement
from .jax_core import current_placement as current_placement
from .jax_core import program as program
from .torch_api import RetraceWarning as RetraceWarning
from .torch_api import TorchFunction as TorchFunction
from .torch_api import broadcast as broadcast
from .torch_api import map_fn as map_fn
from .torch_api import map_reduce as map_reduce
from .torch_api import reduce_mean as reduce_mean
from .torch_api import reduce_sum as reduce_sum
from .torch_api import reduce_weighted_mean as reduce_weighted_mean
from .torch_api import torch_function as torch_function
from .torch_api import trace_counts as trace_counts

__all__ = [
    "Placement",
    "RetraceWarning",
    "TorchFunction",
    "broadcast",
    "current_placement",
    "dlpack",
    "jax_core",
    "map_fn",
    "map_reduce",
    "program",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
    "torch_function",
    "trace_counts",
]
