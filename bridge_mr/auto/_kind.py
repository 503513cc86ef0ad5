"""How `auto` runs and measures a kind of round: what the torch frontend hands it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from bridge_mr.typing import ClientFn, PyTree


class Traced(Protocol):
    """A client function's trace (what `RoundKind.trace_client` returns)."""

    @property
    def jaxpr(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class RoundKind:
    """How `auto` runs and measures one kind of round (in one process, or across several).

    Across processes every rank decides from the same programs and agrees every timing and
    budget (the slowest rank's time, the smallest budget) before it decides anything: the
    ranks pick alike and run the same programs. The decisions on disk are not used there (the
    ranks' disks may disagree).

    Attributes:
      keeping: runs the round (a timed candidate too), keeping its programs.
      program: the JAX round, for the cost model's jaxprs.
      trace_client: traces the client function once, `(fn, server, client, placement, n)`,
        and keeps the trace for the round's programs to evaluate.
      agree_seconds: a timing agreed among the processes.
      agree_budget: a memory budget agreed among the processes.
      across_processes: whether the round spans processes.
    """

    keeping: Callable[..., PyTree]
    program: Callable[..., PyTree]
    trace_client: Callable[[ClientFn, PyTree, PyTree, str, int], Traced]
    agree_seconds: Callable[[float], float]
    agree_budget: Callable[[int], int]
    across_processes: bool = False


def same(value: Any) -> Any:
    """`value` itself: what one process agrees with itself (`RoundKind.agree_seconds`)."""
    return value
