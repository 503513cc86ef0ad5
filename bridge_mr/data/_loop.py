"""The loop over a training's rounds: a cohort and its batches per round, from your seeds."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from bridge_mr.algorithms import ClientSampler

from ._dataset import FederatedDataset
from ._rounds import Round, round_steps


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"bridge_mr.data.rounds({name}=...): expected an int >= {least}, got {value!r}."
        )


def rounds(
    dataset: FederatedDataset,
    num_rounds: int,
    *,
    batch_size: int,
    steps: int | None = None,
    epochs: int | None = None,
    cycle: bool = False,
    sampler: ClientSampler | None = None,
    padding: bool = True,
    generator: torch.Generator | int,
) -> Iterator[Round]:
    """`num_rounds` rounds of `dataset`: each a cohort of `sampler` and its batches.

    The loop a training writes around `FederatedDataset.round`, as a `DataLoader` is the one
    around a dataset: each round draws its cohort (`sampler.sample()`, or every client), then
    the cohort's `[clients, steps, batch_size, ...]` batches, one gather per field on the
    dataset's device. The arguments are checked when called, before the first round. With
    an int `generator` every call starts afresh, so two trainings (two implementations, say)
    that each call `rounds` with the same seed and a new sampler see the same batches.

    Args:
      dataset: the clients' examples.
      num_rounds: how many rounds the iterator yields, >= 0.
      batch_size: examples per local step, >= 1.
      steps: local steps per round (see `FederatedDataset.round`).
      epochs: passes over each client's data (see `FederatedDataset.round`).
      cycle: repeat each client's passes until its `steps` are filled (TFF's
        `repeat().batch(B).take(S)`): `steps` and no `epochs`; no slot is padding, whatever the
        client's size. The passes are `ceil(steps * batch_size / smallest client)` for every
        client (a larger client's last ones cut off).
      sampler: each round's cohort (`dataset.sampler(...)`: uniform, or Poisson for DP), or
        None for every client each round.
      padding: False refuses a client that cannot fill its slots (see `FederatedDataset.round`).
      generator: the batches' order: a `torch.Generator` (its state advances), or an int seed
        of a fresh one for this call.

    Returns:
      An iterator of `num_rounds` `Round`s: `rnd.batches` (the fields and `"mask"`),
      `rnd.weights` (example counts, for `outer_step(weights=...)`), `rnd.client_mask` (for
      `dp_outer_step(mask=...)`) and `rnd.cohort`.

    Raises:
      TypeError: `dataset` is not a `FederatedDataset`, `sampler` not a `ClientSampler`,
        `generator` neither a torch.Generator nor an int, `cycle` not a bool.
      ValueError: a count out of range; `cycle=True` without `steps` or with `epochs`; a
        sampler of another number of clients; and what `FederatedDataset.round` refuses
        (neither `steps` nor `epochs`; a client too short for `padding=False`).

    Example:
      >>> train = bridge_mr.data.FederatedDataset.from_tensors(
      ...     {"x": torch.randn(50, 3)}, bridge_mr.data.IID(num_clients=10, seed=0))
      >>> sampler = train.sampler(cohort_size=4, generator=1)
      >>> for rnd in bridge_mr.data.rounds(  # 5 examples a client fill 4 steps of 2: 2 passes
      ...         train, 3, sampler=sampler, batch_size=2, steps=4, cycle=True, generator=2):
      ...     print(rnd.cohort.indices.tolist(), list(rnd.batches["x"].shape),
      ...           "padding:", int((rnd.batches["mask"] == 0).sum()))
      [1, 2, 5, 6] [4, 4, 2, 3] padding: 0
      [1, 2, 3, 8] [4, 4, 2, 3] padding: 0
      [1, 2, 5, 8] [4, 4, 2, 3] padding: 0
    """
    if not isinstance(dataset, FederatedDataset):
        raise TypeError(
            f"bridge_mr.data.rounds(dataset=...): expected a bridge_mr.data.FederatedDataset, "
            f"got {type(dataset).__name__}. Fix: build one with FederatedDataset.from_tensors, "
            "from_dataset or from_clients (or bridge_mr.data.digits)."
        )
    _check_count("num_rounds", num_rounds, 0)
    _check_count("batch_size", batch_size, 1)
    for name, value in (("steps", steps), ("epochs", epochs)):
        if value is not None:
            _check_count(name, value, 1)
    if not isinstance(cycle, bool):
        raise TypeError(f"bridge_mr.data.rounds(cycle=...): expected a bool, got {cycle!r}.")
    if cycle:
        if steps is None or epochs is not None:
            raise ValueError(
                f"bridge_mr.data.rounds(cycle=True): repeats each client's passes until its "
                f"steps are filled, so expected steps= and no epochs=, got steps={steps!r}, "
                f"epochs={epochs!r}. Fix: steps= alone with cycle=True, or cycle=False."
            )
        epochs = math.ceil(steps * batch_size / int(dataset.example_counts.min()))
    if sampler is not None and not isinstance(sampler, ClientSampler):
        raise TypeError(
            f"bridge_mr.data.rounds(sampler=...): expected a bridge_mr.algorithms.ClientSampler "
            f"(dataset.sampler(...)) or None (every client), got {type(sampler).__name__}."
        )
    if sampler is not None and sampler.num_clients != dataset.num_clients:
        raise ValueError(
            f"bridge_mr.data.rounds(sampler=...): expected a sampler of the dataset's "
            f"{dataset.num_clients} clients, got one of {sampler.num_clients}. Fix: "
            "dataset.sampler(cohort_size=...) or dataset.sampler(probability=...)."
        )
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = torch.Generator().manual_seed(generator)
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "bridge_mr.data.rounds(generator=...): expected a torch.Generator or an int seed, "
            f"got {type(generator).__name__}."
        )
    # What `round` refuses, refused now rather than at the first round.
    round_steps(dataset.example_counts, batch_size, steps, epochs, padding)
    return _rounds(dataset, num_rounds, batch_size, steps, epochs, sampler, padding, generator)


def _rounds(
    dataset: FederatedDataset,
    num_rounds: int,
    batch_size: int,
    steps: int | None,
    epochs: int | None,
    sampler: ClientSampler | None,
    padding: bool,
    generator: torch.Generator,
) -> Iterator[Round]:
    for _ in range(num_rounds):
        cohort = None if sampler is None else sampler.sample()
        yield dataset.round(
            cohort,
            batch_size=batch_size,
            steps=steps,
            epochs=epochs,
            padding=padding,
            generator=generator,
        )
