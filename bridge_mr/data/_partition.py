"""Partitioners: which client holds each example (IID, Dirichlet over labels, shards, a key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

#: How many Dirichlet draws `Dirichlet` tries before giving up on leaving no client too small.
DIRICHLET_TRIES = 100


def _check_count(owner: str, name: str, value: object, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}({name}=...): expected an int >= {least}, got {value!r}.")


def _check_seed(owner: str, seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{owner}(seed=...): expected an int >= 0, got {seed!r}.")


def _column(owner: str, examples: Mapping[str, torch.Tensor], key: str, what: str) -> np.ndarray:
    """`examples[key]` as a 1-d int64 numpy array (on the host), or a clear error."""
    if key not in examples:
        raise ValueError(
            f"{owner}: expected the examples to have the {what} key {key!r}, got keys "
            f"{sorted(examples)}. Fix: name the {what} field, e.g. {owner}(..., {what}="
            f"{sorted(examples)[-1]!r})."
        )
    column = examples[key]
    if column.ndim != 1 or column.dtype.is_floating_point or column.dtype.is_complex:
        raise ValueError(
            f"{owner}: expected examples[{key!r}] to hold one integer {what} per example "
            f"(shape [examples]), got dtype {column.dtype} and shape {list(column.shape)}. Fix: "
            f"class indices, e.g. one_hot.argmax(-1)."
        )
    return column.detach().cpu().numpy().astype(np.int64)


def _num_examples(examples: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(examples.values())).shape[0])


def _ids(assignment: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(assignment, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class IID:
    """Shuffles the examples and deals them to `num_clients` clients in near-equal parts.

    Client sizes differ by at most one example; with `examples_per_client`, every client holds
    exactly that many (a random subset) and the rest is left out (id -1).

    Attributes:
      num_clients: how many clients, >= 1 (at most the number of examples).
      examples_per_client: each client's exact size, or None to deal out every example.
      seed: the shuffle's seed.

    Example:
      >>> examples = {"x": torch.arange(10.0), "y": torch.arange(10) % 2}
      >>> bridge_mr.data.IID(num_clients=3, seed=0)(examples).bincount()
      tensor([4, 3, 3])
    """

    num_clients: int
    examples_per_client: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_count("IID", "num_clients", self.num_clients)
        if self.examples_per_client is not None:
            _check_count("IID", "examples_per_client", self.examples_per_client)
        _check_seed("IID", self.seed)

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id (in [0, num_clients); -1: left out) of each example, int64 [examples].

        Raises:
          ValueError: fewer examples than the clients need.
        """
        n = _num_examples(examples)
        needed = self.num_clients * (self.examples_per_client or 1)
        if n < needed:
            raise ValueError(
                f"IID: {self.num_clients} clients of {self.examples_per_client or 'at least 1'} "
                f"example(s) need {needed} examples, got {n}. Fix: fewer clients."
            )
        order = np.random.default_rng(self.seed).permutation(n)
        if self.examples_per_client is not None:
            order = order[:needed]
        ids = np.full(n, -1, np.int64)
        for client, part in enumerate(np.array_split(order, self.num_clients)):
            ids[part] = client
        return _ids(ids)


@dataclasses.dataclass(frozen=True)
class Dirichlet:
    """Label skew: each label's examples are split over the clients by a Dirichlet(alpha) draw.

    As in Hsu et al. (2019) and Flower's `DirichletPartitioner`: for every label a vector of
    client proportions is drawn from Dirichlet(alpha, ..., alpha) and that label's (shuffled)
    examples are cut by it. Small alpha (0.1) gives each client few labels; large alpha (1000)
    is close to IID.
    The draw is repeated (up to 100 times) until every client holds at least `min_examples`.

    Attributes:
      num_clients: how many clients, >= 1.
      alpha: the concentration, > 0.
      label: the examples' key holding one integer class per example.
      min_examples: the fewest examples a client may hold, >= 1.
      seed: the draws' seed.

    Example:
      >>> y = torch.arange(600) % 6
      >>> ids = bridge_mr.data.Dirichlet(num_clients=4, alpha=0.1, seed=0)({"y": y})
      >>> ids.shape, int(ids.bincount().min()) >= 1
      (torch.Size([600]), True)
    """

    num_clients: int
    alpha: float
    label: str = "y"
    min_examples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        _check_count("Dirichlet", "num_clients", self.num_clients)
        _check_count("Dirichlet", "min_examples", self.min_examples)
        _check_seed("Dirichlet", self.seed)
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(
                f"Dirichlet(alpha=...): expected a concentration > 0 (e.g. 0.1 for strong label "
                f"skew, 100 for nearly IID), got {alpha!r}."
            )

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id (in [0, num_clients)) of each example, an int64 tensor [examples].

        Raises:
          ValueError: the label key is missing or not integer, or no draw in 100 left every
            client `min_examples` examples.
        """
        labels = _column("Dirichlet", examples, self.label, "label")
        if len(labels) < self.num_clients * self.min_examples:
            raise ValueError(
                f"Dirichlet: {self.num_clients} clients of at least {self.min_examples} "
                f"examples need {self.num_clients * self.min_examples} examples, got "
                f"{len(labels)}. Fix: fewer clients (num_clients=...)."
            )
        rng = np.random.default_rng(self.seed)
        by_label = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        for _ in range(DIRICHLET_TRIES):
            ids = np.empty(len(labels), np.int64)
            for members in by_label:
                share = rng.dirichlet(np.full(self.num_clients, float(self.alpha)))
                cuts = (np.cumsum(share)[:-1] * len(members)).astype(np.int64)
                for client, part in enumerate(np.split(rng.permutation(members), cuts)):
                    ids[part] = client
            if np.bincount(ids, minlength=self.num_clients).min() >= self.min_examples:
                return _ids(ids)
        raise ValueError(
            f"Dirichlet: in {DIRICHLET_TRIES} draws with alpha={self.alpha}, some client of "
            f"{self.num_clients} always held fewer than min_examples={self.min_examples} "
            f"examples of the {len(labels)}. Fix: a larger alpha, fewer clients, or a smaller "
            "min_examples."
        )


@dataclasses.dataclass(frozen=True)
class Shards:
    """Pathological label skew (McMahan et al., 2017): label-sorted shards, a few per client.

    The examples, shuffled and then sorted by label, are cut into `num_clients *
    shards_per_client` shards; each client gets `shards_per_client` random ones, so it sees
    about that many labels. Without `shard_size` every example is kept (shards differ by at
    most one example); with it, a random subset of `shards * shard_size` examples is cut into
    equal shards and the rest is left out (id -1), as McMahan et al. and Flower's
    `ShardPartitioner` do.

    Attributes:
      num_clients: how many clients, >= 1.
      shards_per_client: shards each client gets, >= 1.
      label: the examples' key holding one integer class per example.
      shard_size: examples per shard (every client then holds `shards_per_client *
        shard_size`), or None for near-equal shards of all the examples.
      seed: the shuffle's and the deal's seed.

    Example:
      >>> y = torch.arange(100) % 10
      >>> ids = bridge_mr.data.Shards(num_clients=5, shards_per_client=2, seed=0)({"y": y})
      >>> [len(y[ids == c].unique()) for c in range(5)]  # two labels each
      [2, 2, 2, 2, 2]
    """

    num_clients: int
    shards_per_client: int = 2
    label: str = "y"
    shard_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_count("Shards", "num_clients", self.num_clients)
        _check_count("Shards", "shards_per_client", self.shards_per_client)
        if self.shard_size is not None:
            _check_count("Shards", "shard_size", self.shard_size)
        _check_seed("Shards", self.seed)

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id (in [0, num_clients); -1: left out) of each example, int64 [examples].

        Raises:
          ValueError: the label key is missing or not integer, or too few examples.
        """
        labels = _column("Shards", examples, self.label, "label")
        shards = self.num_clients * self.shards_per_client
        needed = shards * (self.shard_size or 1)
        if len(labels) < needed:
            raise ValueError(
                f"Shards: {self.num_clients} clients x {self.shards_per_client} shards of "
                f"{self.shard_size or 'at least 1'} example(s) need {needed} examples, got "
                f"{len(labels)}. Fix: fewer clients or shards, or a smaller shard_size."
            )
        rng = np.random.default_rng(self.seed)
        shuffled = rng.permutation(len(labels))[: needed if self.shard_size else None]
        by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
        owner = rng.permutation(shards) % self.num_clients
        ids = np.full(len(labels), -1, np.int64)
        for shard, part in enumerate(np.array_split(by_label, shards)):
            ids[part] = owner[shard]
        return _ids(ids)


@dataclasses.dataclass(frozen=True)
class NaturalKey:
    """One client per distinct value of an example field (a user, writer or speaker id).

    Client `i` holds the examples whose key is the `i`-th smallest distinct key.

    Attributes:
      key: the examples' key holding one integer id per example.

    Example:
      >>> writers = torch.tensor([7, 3, 7, 9, 3, 7])
      >>> bridge_mr.data.NaturalKey("writer")({"writer": writers})
      tensor([1, 0, 1, 2, 0, 1])
    """

    key: str

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id of each example: the rank of its key among the distinct keys.

        Raises:
          ValueError: the key is missing or not one integer per example.
        """
        column = _column("NaturalKey", examples, self.key, "key")
        return _ids(np.unique(column, return_inverse=True)[1].reshape(-1))
