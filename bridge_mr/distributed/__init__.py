"""Several processes: `initialize()` starts `jax.distributed` from torchrun's environment.

Importing this package starts nothing and imports no torch: `initialize()` does the work, once,
before the process's first JAX computation.
"""

from ._initialize import Process as Process
from ._initialize import initialize as initialize

__all__ = ["Process", "initialize"]
