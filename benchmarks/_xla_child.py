"""Child process in the torch-xla environment: times bridge_mr on torch-xla against pure torch-xla.

Usage (PJRT_DEVICE=CPU): .venv-xla/bin/python -m benchmarks._xla_child '{"configs": [...],
"policy": {...}}'. Prints one JSON line {"rows", "torch", "torch_xla", "device"}.
"""

from __future__ import annotations

import json
import sys

from . import environment


def main(argv: list[str]) -> int:
    """Runs the spec in argv[0]; returns the exit status."""
    spec = json.loads(argv[0])
    environment.configure()  # Leaves XLA_FLAGS alone here: torch_xla is installed.
    # torch_xla before JAX: JAX imported first can hang torch-xla on TPU.
    import torch
    import torch_xla

    from .cases_federated import run_xla_spec

    rows = run_xla_spec(spec)
    print(
        json.dumps(
            {
                "rows": rows,
                "torch": torch.__version__,
                "torch_xla": torch_xla.__version__,
                "device": str(torch_xla.device()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
