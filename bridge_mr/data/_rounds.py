"""One round's batches: which examples fill each client's `[steps, batch]` slots, and the mask."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from bridge_mr.algorithms import Cohort


@dataclasses.dataclass(frozen=True)
class Round:
    """One round's client data, stacked on a leading client axis, and its weights.

    `batches` holds every example field gathered to `[clients, steps, batch_size, ...]` plus
    `"mask"`, `[clients, steps, batch_size]` float32: 1 for a real example, 0 for a padding slot
    (a short client's, or a padding row's). A loss honours it as a masked mean, e.g.
    `sum(mask * per_example) / max(sum(mask), 1)`: a batch of padding only then has loss 0
    and gradient 0 (an SGD step that changes nothing). The rows follow `cohort` as
    `Cohort.gather` does: the sampled clients, then `padded_size - size` padding rows.

    Attributes:
      batches: the example fields and `"mask"`, each `[clients, steps, batch_size, ...]`: torch
        tensors on the dataset's device, or JAX arrays for a dataset on a JAX device
        (`FederatedDataset.to(jax_device)`; `map_reduce` takes them where they are).
      cohort: the clients of the round's rows.
      weights: `[clients]` float32, each row's example count (FedAvg's weight), 0 for padding
        rows: `cohort.weights(dataset.example_counts)`, for `outer_step(weights=...)`.
      client_mask: `[clients]` float32, 1 for a sampled client, 0 for a padding row:
        `cohort.weights()`, for `dp_outer_step(mask=...)`.

    Example:
      >>> train = bridge_mr.data.FederatedDataset.from_clients(
      ...     {"a": {"x": torch.arange(3.0)}, "b": {"x": torch.arange(5.0)}})
      >>> rnd = train.round(batch_size=2, steps=2, generator=torch.Generator().manual_seed(0))
      >>> rnd.batches["mask"]  # client "a" holds 3 examples: its last slot is padding
      tensor([[[1., 1.],
               [1., 0.]],
      <BLANKLINE>
              [[1., 1.],
               [1., 1.]]])
      >>> rnd.weights
      tensor([3., 5.])
    """

    batches: dict[str, Any]
    cohort: Cohort
    weights: torch.Tensor
    client_mask: torch.Tensor


def round_steps(
    counts: torch.Tensor, batch_size: int, steps: int | None, epochs: int | None, padding: bool
) -> tuple[int, int]:
    """`(steps, passes)`: the round's steps, and how many passes over each client's data fill them.

    `counts` is the example count of every client of the dataset (not only the round's): the
    step count then depends on the dataset alone, so every round has one shape.
    """
    if steps is None and epochs is None:
        raise ValueError(
            "FederatedDataset.round: expected steps= (a fixed number of local steps), epochs= "
            "(passes over each client's data) or both (that many passes, cut to that many "
            "steps), got neither."
        )
    for name, value in (("batch_size", batch_size), ("steps", steps), ("epochs", epochs)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"FederatedDataset.round({name}=...): expected an int >= 1, got {value!r}."
            )
    if not isinstance(padding, bool):
        raise TypeError(f"FederatedDataset.round(padding=...): expected a bool, got {padding!r}.")
    if steps is None:
        assert epochs is not None
        steps = math.ceil(epochs * int(counts.max()) / batch_size)
        short = torch.nonzero(epochs * counts != steps * batch_size).flatten()
        if not padding and short.numel():
            client = int(short[0])
            raise ValueError(
                f"FederatedDataset.round(padding=False): {epochs} epoch(s) of client {client}'s "
                f"{int(counts[client])} examples do not fill {steps} steps x batch_size="
                f"{batch_size} exactly ({epochs} x the largest client's {int(counts.max())} "
                "examples set the steps). Fix: padding=True (masked slots), steps= as well "
                "(the passes cut to that many steps), or clients of equal size."
            )
        return steps, epochs
    passes = 1 if epochs is None else epochs
    short = torch.nonzero(passes * counts < steps * batch_size).flatten()
    if not padding and short.numel():
        client = int(short[0])
        raise ValueError(
            f"FederatedDataset.round(padding=False): steps={steps} x batch_size={batch_size} = "
            f"{steps * batch_size} examples per client, but {passes} pass(es) over client "
            f"{client}'s {int(counts[client])} examples give only {passes * int(counts[client])}"
            f" ({short.numel()} client(s) fall short). Fix: padding=True (the missing slots "
            "masked), more epochs=, or fewer steps or a smaller batch_size."
        )
    return steps, passes


def round_index(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    slots: int,
    passes: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The example index and mask `[rows, slots]` of a round, without a loop over the clients.

    Row `r` (client `rows[r]`, or a padding row where `rows[r] < 0`) fills its slots with
    `passes` passes over its examples, each pass a fresh random order, one pass after the
    other, and then padding (mask 0). One sort of one random key per example and pass
    orders every row's passes at once. All on the host: the gather of the examples by this
    index is the only work on the dataset's device.
    """
    take = torch.index_select  # On the host several times faster than advanced indexing.
    real = rows >= 0
    row_counts = torch.where(real, take(counts, 0, rows.clamp(min=0)), 0)
    row_offsets = torch.where(real, take(offsets, 0, rows.clamp(min=0)), 0)
    lengths = row_counts * passes
    total = int(lengths.sum())
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths, output_size=total)
    # Within row r, a rank in [0, passes * n_r): which pass (rank // n_r) and which example.
    starts = torch.cumsum(lengths, 0) - lengths
    count_of = take(row_counts, 0, row_of)
    rank = torch.arange(total) - take(starts, 0, row_of)
    pass_of = torch.div(rank, count_of.clamp(min=1), rounding_mode="floor")
    example = take(row_offsets, 0, row_of) + rank - pass_of * count_of
    # Sorted by row, then pass, then a uniform key: each pass a random permutation.
    keys = (row_of * passes + pass_of).to(torch.float64) + torch.rand(
        total, generator=generator, dtype=torch.float64
    )
    ordered = take(example, 0, torch.argsort(keys))
    position = torch.arange(slots)
    filled = position < lengths.unsqueeze(1)
    if total:
        source = (starts.unsqueeze(1) + position).clamp(max=total - 1)
        drawn = take(ordered, 0, source.flatten()).view(source.shape)
    else:
        drawn = torch.zeros(len(rows), slots, dtype=torch.int64)
    # A padding slot repeats the row's first example (padding rows: example 0), masked out.
    index = torch.where(filled, drawn, row_offsets.unsqueeze(1))
    return index, filled.to(torch.float32)
