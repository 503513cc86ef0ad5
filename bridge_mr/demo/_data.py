"""scikit-learn's digits, split non-IID over the clients by `bridge_mr.data`, and their batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import torch

import bridge_mr

N_FEATURES = 64
N_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class FederatedDigits:
    """The clients' training data (`bridge_mr.data.FederatedDataset`) and a held-out test split.

    Every client holds `per_client` examples: features [64] float32 in [0, 1] ("x"), class
    indices int64 ("y"); `test_x` / `test_y` likewise.
    """

    train: bridge_mr.data.FederatedDataset
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def n_clients(self) -> int:
        """The number of clients."""
        return self.train.num_clients

    @property
    def per_client(self) -> int:
        """The number of training examples each client holds (all hold as many)."""
        return int(self.train.example_counts[0])

    @property
    def client_y(self) -> torch.Tensor:
        """Every client's labels, [clients, per_client]."""
        return self.train.examples["y"].view(self.n_clients, self.per_client)


def load_federated_digits(
    n_clients: int, *, seed: int = 0, test_fraction: float = 0.2
) -> FederatedDigits:
    """Splits digits into a stratified test set and `n_clients` label-skewed training shards.

    Label skew follows McMahan et al. (2017), `bridge_mr.data.Shards`: the training examples,
    sorted by label, are cut into 2·n_clients equal shards and each client gets two random
    shards, so most clients see only two or three digits. Examples that do not fill a whole
    shard (chosen at random) are left out.
    """

    def shards(examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total = len(examples["y"])
        if not 1 <= n_clients <= total // 2:
            raise ValueError(
                f"n_clients must be between 1 and {total // 2} (two non-empty shards of the "
                f"{total} training examples each); got {n_clients}."
            )
        size = total // (2 * n_clients)
        return bridge_mr.data.Shards(n_clients, shard_size=size, seed=seed)(examples)

    train, test = bridge_mr.data.digits(shards, test_fraction=test_fraction, seed=seed)
    return FederatedDigits(train, test["x"], test["y"])


def client_batches(
    data: FederatedDigits,
    *,
    rounds: int,
    batch_size: int,
    local_steps: int | None = None,
    seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yields one batch per round for every client: {"x": ..., "y": ...}.

    Shapes are [clients, batch_size, ...], or [clients, local_steps, batch_size, ...] when
    `local_steps` is given: `FederatedDataset.round`'s passes over each client's shard, each in
    a fresh order, cut to the steps. The sequence depends only on `seed`, so every
    implementation sees the same data; no slot is padding (every client holds as many).
    """
    if not 1 <= batch_size <= data.per_client:
        raise ValueError(
            f"batch_size must be between 1 and the {data.per_client} examples per client; "
            f"got {batch_size}."
        )
    generator = torch.Generator().manual_seed(seed)
    steps = 1 if local_steps is None else local_steps
    passes = math.ceil(steps * batch_size / data.per_client)
    for _ in range(rounds):
        batches = data.train.round(
            batch_size=batch_size, steps=steps, epochs=passes, padding=False, generator=generator
        ).batches
        batch = {"x": batches["x"], "y": batches["y"]}
        if local_steps is None:
            batch = {name: value.squeeze(1) for name, value in batch.items()}
        yield batch
