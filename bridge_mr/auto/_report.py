"""What `map_reduce(strategy="auto")` reports: its `Candidate`s and `Choice`s, in words and
as the JSON records kept on disk (`_decisions`)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import jax
import torch

from bridge_mr import jax_core
from bridge_mr.typing import PyTree, Strategy

from ._cost import Cost

#: A candidate of `auto`: a strategy and its chunk size (None but for "chunks").
Option = tuple[Strategy, int | None]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy `auto` considered for a signature, with what it found.

    Attributes:
      strategy: "vmap", "per_client" or "chunks".
      chunk_size: the chunk size for "chunks", else None.
      memory_bytes: the estimated peak memory of the call's program (arguments, outputs and
        intermediates, each freed after its last use), read from its forward jaxpr without
        compiling it (with gradients: scaled for the backward pass, see `_reading.round_cost`),
        or None where it could not be traced.
      seconds: the median of the timed calls, or None when it was not timed (the default:
        only with `AUTO_TIMING` are candidates timed).
      skipped: why it was not picked without timing, or not timed ("" for the one picked, or
        timed).
      timed_calls: how many calls were timed (`AUTO_TIMING`): `AUTO_REPEATS`, fewer when the
        first took over `AUTO_GIVE_UP` times the fastest candidate's first, or 0.
      flops: the floating-point operations of its matrix products and convolutions, by the
        cost model (with gradients: about 3x the forward's, 4x for per_client), or None where
        it could not be traced.

    Example:
      >>> bridge_mr.map_reduce(jax_loss, params, batch).backward()  # strategy="auto" decides
      >>> vmap, per_client = bridge_mr.map_reduce_choices()[-1].candidates
      >>> vmap.strategy, vmap.skipped, per_client.skipped
      ('vmap', '', 'not timed: the cost model prefers vmap')
      >>> vmap.seconds, vmap.timed_calls  # not timed (only with AUTO_TIMING)
      (None, 0)
    """

    strategy: Strategy
    chunk_size: int | None
    memory_bytes: int | None
    seconds: float | None
    skipped: str = ""
    timed_calls: int = 0
    flops: float | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `map_reduce(strategy="auto")` picked for one signature, and why.

    Attributes:
      signature: the call it was made for, in words (function, shapes, dtypes, reduction).
      strategy: the strategy picked.
      chunk_size: its chunk size ("chunks"), else None.
      reason: why it was picked.
      candidates: every candidate considered, vmap first.
      memory_budget_bytes: the budget the candidates' memory estimates were held to.
      measure_seconds: the wall time deciding took (the client's trace and the cost model;
        with `AUTO_TIMING`, the timed calls and their compilations).
      from_disk: the decision was read from the decisions on disk (made by an earlier
        process), not made again.

    Example:
      >>> bridge_mr.map_reduce(jax_loss, params, batch).backward()  # strategy="auto" decides
      >>> choice = bridge_mr.map_reduce_choices()[-1]
      >>> choice.strategy, choice.chunk_size, choice.reason
      ('vmap', None, 'the cost model: no candidate needs 10% fewer operations')
      >>> "with gradients" in choice.signature
      True
    """

    signature: str
    strategy: Strategy
    chunk_size: int | None
    reason: str
    candidates: tuple[Candidate, ...]
    memory_budget_bytes: int
    measure_seconds: float
    from_disk: bool = False


def candidates(
    options: list[Option],
    costs: dict[Option, Cost | None],
    skipped: dict[Option, str],
    times: dict[Option, list[float]],
) -> tuple[Candidate, ...]:
    found = []
    for option in options:
        c, timed = costs[option], times.get(option, [])
        found.append(
            Candidate(
                option[0],
                option[1],
                None if c is None else c.peak_bytes,
                statistics.median(timed) if timed else None,
                skipped.get(option, ""),
                len(timed),
                None if c is None else c.flops,
            )
        )
    return tuple(found)


def record(choice: Choice) -> dict[str, Any]:
    """`choice` as the JSON kept on disk."""
    return {
        "strategy": choice.strategy,
        "chunk_size": choice.chunk_size,
        "reason": choice.reason,
        "memory_budget_bytes": choice.memory_budget_bytes,
        "candidates": [dataclasses.asdict(c) for c in choice.candidates],
    }


def from_record(record: dict[str, Any], signature: str) -> Choice | None:
    """The choice kept on disk, or None when the record is not a valid one."""
    try:
        candidates = tuple(Candidate(**c) for c in record["candidates"])
        choice = Choice(
            signature,
            record["strategy"],
            record["chunk_size"],
            str(record["reason"]),
            candidates,
            int(record["memory_budget_bytes"]),
            0.0,
            from_disk=True,
        )
    except (KeyError, TypeError, ValueError):
        return None
    options = {(c.strategy, c.chunk_size) for c in candidates}
    if (choice.strategy, choice.chunk_size) not in options or (
        choice.strategy not in jax_core.STRATEGIES
    ):
        return None
    return choice


def describe(fn: Any, server: PyTree, clients: PyTree, reduce: str, grads: bool) -> str:
    def shapes(tree: PyTree) -> str:  # Tensors, and JAX arrays (already on the device).
        return ", ".join(
            f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            + ("" if isinstance(t, torch.Tensor) else " (jax)")
            for t in jax.tree.leaves(tree)
            if isinstance(t, torch.Tensor | jax.Array)
        )

    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (
        f"map_reduce({name}, server=[{shapes(server)}], clients=[{shapes(clients)}], "
        f"reduce={reduce!r}{', with gradients' if grads else ''})"
    )


def label(strategy: str, chunk_size: int | None) -> str:
    if strategy in ("chunks", "packed"):
        return f"{'packed ' if strategy == 'packed' else ''}chunks of {chunk_size}"
    return strategy


def candidate_text(candidate: Candidate) -> str:
    memory = "?" if candidate.memory_bytes is None else f"{candidate.memory_bytes / 2**20:.1f} MiB"
    flops = "?" if candidate.flops is None else f"{candidate.flops:.3g} flops"
    timing = "" if candidate.seconds is None else f", {candidate.seconds * 1e3:.2f} ms"
    skipped = f" ({candidate.skipped})" if candidate.skipped else ""
    return f"{label(candidate.strategy, candidate.chunk_size)}: {memory}, {flops}{timing}{skipped}"
