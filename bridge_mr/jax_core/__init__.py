"""Placement-aware MapReduce primitives in plain JAX (usable without torch)."""

from . import settings as settings
from ._api import broadcast as broadcast
from ._api import map_fn as map_fn
from ._api import reduce_mean as reduce_mean
from ._api import reduce_sum as reduce_sum
from ._api import reduce_weighted_mean as reduce_weighted_mean
from ._arguments import STRATEGIES as STRATEGIES
from ._arguments import check_strategy as check_strategy
from ._arguments import client_count as client_count
from ._clear import clear_caches as clear_caches
from ._cpu import accurate_sums as accurate_sums
from ._cpu import cpu_compiler_options as cpu_compiler_options
from ._cpu import cpu_program as cpu_program
from ._grouped import matmul_convolutions as matmul_convolutions
from ._layouts import canonical_layouts as canonical_layouts
from ._layouts import program_platform as program_platform
from ._layouts import programs_for as programs_for
from ._map_reduce import map_reduce as map_reduce
from ._maps import map_p as map_p
from ._mesh import ambient_mesh as ambient_mesh
from ._mesh import check_mesh as check_mesh
from ._packed import vmap_packed as vmap_packed
from ._primitives import broadcast_p as broadcast_p
from ._primitives import mean_p as mean_p
from ._primitives import sum_p as sum_p
from ._program import Placement as Placement
from ._program import current_placement as current_placement
from ._program import program as program

__all__ = [
    "STRATEGIES",
    "Placement",
    "accurate_sums",
    "ambient_mesh",
    "broadcast",
    "broadcast_p",
    "canonical_layouts",
    "check_mesh",
    "check_strategy",
    "clear_caches",
    "client_count",
    "cpu_compiler_options",
    "cpu_program",
    "current_placement",
    "map_fn",
    "map_p",
    "map_reduce",
    "matmul_convolutions",
    "mean_p",
    "program",
    "program_platform",
    "programs_for",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
    "settings",
    "sum_p",
    "vmap_packed",
]
