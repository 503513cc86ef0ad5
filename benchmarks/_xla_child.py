"""Child process in the torch-xla environment: times bridge_mr on torch-xla against pure torch-xla.

Usage (PJRT_DEVICE=CPU): .venv-xla/bin/python -m benchmarks._xla_child '{"configs": [...],
"policy": {...}}'. Prints one JSON line {"rows", "torch", "torch_xla", "device", "xla_flags"}.
"""

from __future__ import annotations

import json
import sys

from . import environment


def main(argv: list[str]) -> int:
    """Runs the spec in argv[0]; returns the exit status."""
    spec = json.loads(argv[0])
    environment.configure()  # Here: drops the YNN flag, which torch_xla's XLA aborts on.
    # torch_xla before JAX: JAX imported first can hang torch-xla on TPU.
    import torch_xla  # noqa: F401

    from .cases_federated import run_xla_spec

    print(json.dumps(run_xla_spec(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
