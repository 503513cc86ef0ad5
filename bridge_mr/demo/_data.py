"""scikit-learn's digits, split non-IID into equal-size client shards, and per-round batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

N_FEATURES = 64
N_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class FederatedDigits:
    """Client shards stacked on a leading client axis, and a held-out test split.

    `client_x` is [clients, per_client, 64] float32 in [0, 1]; `client_y` holds the matching
    class indices [clients, per_client] (int64), as `test_y` does for `test_x`.
    """

    client_x: torch.Tensor
    client_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def n_clients(self) -> int:
        """The number of clients (the leading dimension of the client tensors)."""
        return self.client_x.shape[0]

    @property
    def per_client(self) -> int:
        """The number of training examples each client holds."""
        return self.client_x.shape[1]


def load_federated_digits(
    n_clients: int, *, seed: int = 0, test_fraction: float = 0.2
) -> FederatedDigits:
    """Splits digits into a stratified test set and `n_clients` label-skewed training shards.

    Label skew follows McMahan et al. (2017): the training examples, sorted by label, are cut
    into 2·n_clients equal shards and each client gets two random shards, so most clients see
    only two or three digits. Examples that do not fill a whole shard (chosen at random) are
    dropped.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed
    )
    if not 1 <= n_clients <= len(y_train) // 2:
        raise ValueError(
            f"n_clients must be between 1 and {len(y_train) // 2} (two non-empty shards of the "
            f"{len(y_train)} training examples each); got {n_clients}."
        )
    shard_size = len(y_train) // (2 * n_clients)
    rng = np.random.default_rng(seed)
    kept = rng.permutation(len(y_train))[: 2 * n_clients * shard_size]
    by_label = kept[np.argsort(y_train[kept], kind="stable")]
    shards = by_label.reshape(2 * n_clients, shard_size)
    client_index = shards[rng.permutation(2 * n_clients)].reshape(n_clients, 2 * shard_size)
    return FederatedDigits(
        client_x=torch.from_numpy(x_train[client_index]),
        client_y=torch.from_numpy(np.asarray(y_train, dtype=np.int64)[client_index]),
        test_x=torch.from_numpy(x_test),
        test_y=torch.from_numpy(np.asarray(y_test, dtype=np.int64)),
    )


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
    `local_steps` is given. Each step's examples are drawn from the client's own shard without
    replacement; the sequence depends only on `seed`, so every implementation sees the same data.
    """
    if not 1 <= batch_size <= data.per_client:
        raise ValueError(
            f"batch_size must be between 1 and the {data.per_client} examples per client; "
            f"got {batch_size}."
        )
    generator = torch.Generator().manual_seed(seed)
    steps = 1 if local_steps is None else local_steps
    device = data.client_x.device
    clients = torch.arange(data.n_clients, device=device).view(-1, 1, 1)
    for _ in range(rounds):
        keys = torch.rand(data.n_clients, steps, data.per_client, generator=generator)
        index = keys.argsort(dim=-1)[..., :batch_size].to(device)
        batch = {"x": data.client_x[clients, index], "y": data.client_y[clients, index]}
        if local_steps is None:
            batch = {name: value.squeeze(1) for name, value in batch.items()}
        yield batch
