"""What a split program ships to the workers: serialized segments and how they connect.

Plain data (bytes, ints, numpy dtypes): a plan pickles without JAX's tracing machinery, and the
worker code that runs it imports only jax and numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Segment:
    """One exported segment: `jax.export` bytes and its calling convention.

    Called as f(carrier, *client_in, *server_in) where `carrier` is an empty float32[n, 0]
    array giving the client count n. A client segment returns (*carry, *contributions), every
    placed value with the client axis first; a server segment returns its server values.
    """

    name: str
    serialized: bytes
    num_client_in: int
    num_client_out: int
    num_contributions: int


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One client_to_server_aggregation: a sum (or mean) over clients of a contribution."""

    kind: str  # "sum" or "mean"
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A program split into rounds.

    `segments` alternates server_0, client_0, server_1, ..., server_K (K = number of rounds
    with reductions); `reductions[k]` are round k's, in the order of client_k's contributions.
    `outputs` says where each result leaf comes from: ("env", i), the i-th value of the last
    server segment, or ("literal", value).
    """

    placement: str
    segments: list[Segment]
    reductions: list[list[Reduction]]
    outputs: list[tuple[str, Any]]
    out_tree: Any
    consts: list[np.ndarray[Any, Any]]
    server_tree: Any  # Of the tuple of server arguments.
    record_tree: Any  # Of one client record (a tuple of the placed arguments).
    record_avals: list[tuple[tuple[int, ...], np.dtype[Any]]]

    @property
    def num_rounds(self) -> int:
        """How many rounds of client work and aggregation the program has."""
        return len(self.reductions)

    def server_segment(self, k: int) -> Segment:
        """Round k's server segment (k = num_rounds: server_result)."""
        return self.segments[2 * k]

    def client_segment(self, k: int) -> Segment:
        """Round k's client segment."""
        return self.segments[2 * k + 1]
