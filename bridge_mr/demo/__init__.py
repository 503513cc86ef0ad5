"""A federated-learning demo: a torch MLP trained on digits through `bridge_mr.map_reduce`.

Run it with `python -m bridge_mr.demo` (or `main([...])` with the same arguments), or call
`run_demo(DemoConfig(...))` for its results as data. The demo is a leaf: the library, the
benchmarks and the examples import nothing from it, so changing it changes no measurement.
"""

from ._cli import main as main
from ._run import DemoConfig as DemoConfig
from ._run import DemoResult as DemoResult
from ._run import run_demo as run_demo
from ._train import PhaseResult as PhaseResult

__all__ = ["DemoConfig", "DemoResult", "PhaseResult", "main", "run_demo"]
