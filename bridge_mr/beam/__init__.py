"""MapReduce programs interpreted to Apache Beam pipelines (the `beam` extra).

`run(fn, server_args, client_records)` traces `fn` with a symbolic client count, splits it into
the phases of TFF's DistributeAggregateForm (server_prepare, broadcast, client_work,
client_to_server_aggregation, server_result) and runs them as a Beam pipeline; `MapReduce` is
the same as a `PTransform` for your own pipelines; `split` and `interpret` expose the plan.
Importing this loads jax and apache_beam, never torch; the worker code imports only jax and
numpy.
"""

from ._plan import Plan as Plan
from ._run import DEFAULT_RUNNER as DEFAULT_RUNNER
from ._run import Aggregate as Aggregate
from ._run import MapReduce as MapReduce
from ._run import interpret as interpret
from ._run import run as run
from ._run import split as split
from ._split import UnsupportedProgramError as UnsupportedProgramError

__all__ = [
    "DEFAULT_RUNNER",
    "Aggregate",
    "MapReduce",
    "Plan",
    "UnsupportedProgramError",
    "interpret",
    "run",
    "split",
]
