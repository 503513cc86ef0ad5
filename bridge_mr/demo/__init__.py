"""A federated-learning demo: a torch MLP trained on digits through `bridge_mr.map_reduce`.

The model and its client loss are written once, in torch: bridge_mr's clients run that loss as
JAX operations (`bridge_mr.from_torch`); two pure-torch baselines run the same training, one
with `torch.func.vmap`, one as the loop over clients a torch user writes (`nn.Module`,
`torch.optim`). The report shows each implementation's first round (for bridge_mr: tracing and
compilation) apart from its later rounds, and where bridge_mr is slower. Run it with
`python -m bridge_mr.demo` (or `main([...])` with the same arguments), or call
`run_demo(DemoConfig(...))` for its results as data. The demo is a leaf: the library, the
benchmarks and the examples import nothing from it, so changing it changes no measurement.
"""

from ._cli import main as main
from ._report import Comparison as Comparison
from ._run import DemoConfig as DemoConfig
from ._run import DemoResult as DemoResult
from ._run import run_demo as run_demo
from ._train import PhaseResult as PhaseResult

__all__ = ["Comparison", "DemoConfig", "DemoResult", "PhaseResult", "main", "run_demo"]
