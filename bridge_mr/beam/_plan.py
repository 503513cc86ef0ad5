"""What a split program ships to the workers: serialized segments and how they connect.

Plain data (bytes, ints, numpy dtypes): a plan pickles without JAX's tracing machinery, and the
worker code that runs it imports only jax and numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

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
class Aggregation:
    """One client_to_server_aggregation of a round: a sum (or mean) over clients of a
    contribution, and the server value's shape and dtype.

    Plain data, unlike `bridge_mr.typing.Reduction` (how `map_reduce` combines its clients):
    a round's "weighted_mean" reaches the plan as two sums.
    """

    kind: Literal["sum", "mean"]
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A program split into rounds: what `split` returns and `run` executes.

    Plain data: it pickles without JAX's tracing machinery.

    Attributes:
        placement: The placement name the program's primitives use.
        segments: The exported segments, alternating server_0, client_0, server_1, ...,
            server_K (K = `num_rounds`, the number of rounds with aggregations).
        aggregations: `aggregations[k]` are round k's, in the order of client_k's
            contributions.
        outputs: Where each result leaf comes from: ("env", i), the i-th value of the last
            server segment, or ("literal", value).
        out_tree: The tree structure of the program's result.
        consts: The program's constants (numpy arrays), passed to server_0.
        server_tree: The tree structure of the tuple of server arguments.
        record_tree: The tree structure of one client record (a tuple of the placed
            arguments).
        record_avals: Each record leaf's per-client (shape, dtype).

    Example:
      >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
      >>> plan.num_rounds, plan.outputs, plan.record_avals
      (1, [('env', 0)], [((), dtype('float32'))])
    """

    placement: str
    segments: list[Segment]
    aggregations: list[list[Aggregation]]
    outputs: list[tuple[str, Any]]
    out_tree: Any
    consts: list[np.ndarray[Any, Any]]
    server_tree: Any  # Of the tuple of server arguments.
    record_tree: Any  # Of one client record (a tuple of the placed arguments).
    record_avals: list[tuple[tuple[int, ...], np.dtype[Any]]]

    @property
    def num_rounds(self) -> int:
        """How many rounds of client work and aggregation the program has."""
        return len(self.aggregations)

    def server_segment(self, k: int) -> Segment:
        """Round k's server segment (k = num_rounds: server_result).

        Args:
            k: The round, from 0 to `num_rounds`.

        Returns:
            `segments[2 * k]`: server_0 prepares round 0's broadcast, server_k (k >= 1)
            consumes round k - 1's aggregations.

        Example:
          >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
          >>> plan.server_segment(0).name, plan.server_segment(plan.num_rounds).name
          ('server_0', 'server_1')
        """
        return self.segments[2 * k]

    def client_segment(self, k: int) -> Segment:
        """Round k's client segment.

        Args:
            k: The round, from 0 to `num_rounds - 1`.

        Returns:
            `segments[2 * k + 1]`: round k's client_work, which returns the bundle's carry
            for later rounds and its contributions to `aggregations[k]`.

        Example:
          >>> plan = bridge_mr.beam.split(scaled_mean, (np.float32(2),), (np.float32(0),))
          >>> segment = plan.client_segment(0)
          >>> segment.name, segment.num_client_in, segment.num_contributions
          ('client_0', 1, 1)
        """
        return self.segments[2 * k + 1]
