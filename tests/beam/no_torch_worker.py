"""A dask worker preload: torch cannot be imported in the worker process.

Loaded by tests/beam/test_dask.py's cluster (`preload=[this file]`) before any task runs, so
every pipeline those workers run proves that Beam workers need no torch.
"""

import sys

for _name in ("torch", "torchax", "functorch", "torch_xla"):
    sys.modules[_name] = None  # type: ignore[assignment]  # Any import of it raises ImportError.
