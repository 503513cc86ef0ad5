"""The torch frontend: JAX functions and MapReduce primitives on torch tensors, with autograd."""

from bridge_mr.auto import Candidate as Candidate
from bridge_mr.auto import Choice as Choice
from bridge_mr.auto import map_reduce_choices as map_reduce_choices
from bridge_mr.jax_core import clear_caches as clear_caches

from ._function import RetraceWarning as RetraceWarning
from ._function import TorchFunction as TorchFunction
from ._function import torch_function as torch_function
from ._map_reduce import map_reduce as map_reduce
from ._map_reduce import trace_counts as trace_counts
from ._ops import broadcast as broadcast
from ._ops import map_fn as map_fn
from ._ops import reduce_mean as reduce_mean
from ._ops import reduce_sum as reduce_sum
from ._ops import reduce_weighted_mean as reduce_weighted_mean

__all__ = [
    "Candidate",
    "Choice",
    "RetraceWarning",
    "TorchFunction",
    "broadcast",
    "clear_caches",
    "map_fn",
    "map_reduce",
    "map_reduce_choices",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
    "torch_function",
    "trace_counts",
]
