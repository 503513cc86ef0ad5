"""Several processes: one program over every process's devices and clients.

`initialize()` starts `jax.distributed` from torchrun's environment; afterwards
`bridge_mr.map_reduce` maps over the union of every rank's clients (each rank passes its own)
and returns the global reduction on every rank. Importing this package starts nothing and
imports no torch: `initialize()` does the work, once, before the process's first JAX
computation.

The layout names (`Layout`, `agree`, `global_array`, `local_part`, ...) are the plain-JAX side
of that cross-process call, which the torch frontend and its runners build on.
"""

from ._initialize import Process as Process
from ._initialize import current as current
from ._initialize import initialize as initialize
from ._layout import Layout as Layout
from ._layout import agree as agree
from ._layout import agree_minimum as agree_minimum
from ._layout import agree_seconds as agree_seconds
from ._layout import constrain as constrain
from ._layout import global_array as global_array
from ._layout import local_part as local_part
from ._layout import multi_process as multi_process
from ._layout import slot_for as slot_for

__all__ = [
    "Layout",
    "Process",
    "agree",
    "agree_minimum",
    "agree_seconds",
    "constrain",
    "current",
    "global_array",
    "initialize",
    "local_part",
    "multi_process",
    "slot_for",
]
