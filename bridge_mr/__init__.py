"""bridge_mr: DrJAX-style MapReduce primitives as JAX primitives, callable from PyTorch.

The JAX-level API lives in `bridge_mr.jax_core`; the DLPack bridge in `bridge_mr.dlpack`.
"""

from . import dlpack as dlpack
from . import jax_core as jax_core
from .jax_core import Placement as Placement
from .jax_core import broadcast as broadcast
from .jax_core import current_placement as current_placement
from .jax_core import map_fn as map_fn
from .jax_core import program as program
from .jax_core import reduce_mean as reduce_mean
from .jax_core import reduce_sum as reduce_sum
from .jax_core import reduce_weighted_mean as reduce_weighted_mean

__all__ = [
    "Placement",
    "broadcast",
    "current_placement",
    "dlpack",
    "jax_core",
    "map_fn",
    "program",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
]
