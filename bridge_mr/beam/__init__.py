"""MapReduce programs interpreted to Apache Beam pipelines (the `beam` extra).

`run(fn, server_args, client_records)` traces `fn` with a symbolic client count, splits it into
the phases of TFF's DistributeAggregateForm (server_prepare, broadcast, client_work,
client_to_server_aggregation, server_result) and runs them as a Beam pipeline; `MapReduce` is
the same as a `PTransform` for your own pipelines; `split` and `interpret` expose the plan.
Importing this loads jax, never torch; apache_beam is imported on first use of `run`,
`MapReduce`, `Aggregate` or `DEFAULT_RUNNER`, so `split` and `interpret` work without it. The
worker code imports only jax and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._plan import Plan as Plan
from ._planning import interpret as interpret
from ._planning import split as split
from ._rules import UnsupportedProgramError as UnsupportedProgramError

if TYPE_CHECKING:
    from ._pipeline import DEFAULT_RUNNER as DEFAULT_RUNNER
    from ._pipeline import Aggregate as Aggregate
    from ._pipeline import MapReduce as MapReduce
    from ._pipeline import run as run

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

_PIPELINE_NAMES = frozenset({"DEFAULT_RUNNER", "Aggregate", "MapReduce", "run"})


def __getattr__(name: str) -> Any:
    """Loads the names that build Beam pipelines on first access (they import apache_beam).

    Raises:
        AttributeError: `name` is not a name of this module.
        ImportError: apache_beam is not installed (install the `beam` extra).
    """
    if name not in _PIPELINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        pipeline = importlib.import_module(f"{__name__}._pipeline")
    except ImportError as err:
        if err.name != "apache_beam":
            raise
        raise ImportError(
            f"bridge_mr.beam.{name} builds Apache Beam pipelines and needs apache_beam: "
            "pip install 'bridge_mr[beam]'. (split and interpret work without it.)",
            name="apache_beam",
        ) from err
    value = getattr(pipeline, name)
    globals()[name] = value  # Later lookups find it without calling __getattr__.
    return value


def __dir__() -> list[str]:
    """The public names, the lazy ones included (listing them loads nothing)."""
    return sorted(__all__)
