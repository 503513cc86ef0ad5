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


def _check_drop_remainder(owner: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}(drop_remainder=...): expected a bool, got {value!r}.")


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
    """Shuffles the examples and deals them to the clients in near-equal or equal parts.

    Client sizes differ by at most one example. Every client holds exactly as many (a random
    subset; the rest is left out, id -1) with `examples_per_client`, or with
    `drop_remainder=True`, which gives each of `num_clients` clients `examples // num_clients`
    (as `batch(..., drop_remainder=True)` does in tf.data). `examples_per_client` alone makes
    as many clients of that size as the examples fill.

    Attributes:
      num_clients: how many clients, >= 1 (at most the number of examples); None with
        `examples_per_client`: as many as the examples fill.
      examples_per_client: each client's exact size, or None to deal out every example.
      seed: the shuffle's seed.
      drop_remainder: equal clients of `examples // num_clients` examples, the rest left out.

    Example:
      >>> examples = {"x": torch.arange(10.0), "y": torch.arange(10) % 2}
      >>> bridge_mr.data.IID(num_clients=3, seed=0)(examples).bincount()
      tensor([4, 3, 3])
      >>> ids = bridge_mr.data.IID(num_clients=3, drop_remainder=True)(examples)
      >>> ids[ids >= 0].bincount(), int((ids == -1).sum())  # one example left out
      (tensor([3, 3, 3]), 1)
      >>> int(bridge_mr.data.IID(examples_per_client=4)(examples).max()) + 1  # clients
      2
    """

    num_clients: int | None = None
    examples_per_client: int | None = None
    seed: int = 0
    drop_remainder: bool = False

    def __post_init__(self) -> None:
        if self.num_clients is None and self.examples_per_client is None:
            raise ValueError(
                "IID: expected num_clients= (how many clients), examples_per_client= (each "
                "client's size: as many clients as the examples fill) or both, got neither."
            )
        if self.num_clients is not None:
            _check_count("IID", "num_clients", self.num_clients)
        if self.examples_per_client is not None:
            _check_count("IID", "examples_per_client", self.examples_per_client)
        _check_seed("IID", self.seed)
        _check_drop_remainder("IID", self.drop_remainder)
        sized = self.examples_per_client is not None
        if self.drop_remainder and (self.num_clients is None or sized):
            raise ValueError(
                f"IID(drop_remainder=True): sizes num_clients= clients equally, so expected "
                f"num_clients and no examples_per_client, got num_clients={self.num_clients!r}, "
                f"examples_per_client={self.examples_per_client!r}. Fix: drop_remainder=True "
                "with num_clients only, or examples_per_client (every client already that size)."
            )

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id (in [0, num_clients); -1: left out) of each example, int64 [examples].

        Raises:
          ValueError: fewer examples than the clients need.
        """
        n = _num_examples(examples)
        clients, size = self.num_clients, self.examples_per_client
        if clients is None:
            assert size is not None
            clients = n // size
            if clients == 0:
                raise ValueError(
                    f"IID(examples_per_client={size}): one client of {size} examples needs "
                    f"{size} examples, got {n}. Fix: a smaller examples_per_client."
                )
        elif self.drop_remainder:
            size = n // clients or None  # None: too few examples, refused below.
        needed = clients * (size or 1)
        if n < needed:
            raise ValueError(
                f"IID: {clients} clients of {size or 'at least 1'} example(s) need {needed} "
                f"examples, got {n}. Fix: fewer clients."
            )
        order = np.random.default_rng(self.seed).permutation(n)
        if size is not None:
            order = order[:needed]
        ids = np.full(n, -1, np.int64)
        for client, part in enumerate(np.array_split(order, clients)):
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
    `ShardPartitioner` do. `drop_remainder=True` takes the largest such size,
    `examples // shards` (Flower's default, `keep_incomplete_shard=False`).

    Attributes:
      num_clients: how many clients, >= 1.
      shards_per_client: shards each client gets, >= 1.
      label: the examples' key holding one integer class per example.
      shard_size: examples per shard (every client then holds `shards_per_client *
        shard_size`), or None for near-equal shards of all the examples.
      seed: the shuffle's and the deal's seed.
      drop_remainder: equal shards of `examples // (num_clients * shards_per_client)`
        examples, the rest left out (not with `shard_size`).

    Example:
      >>> y = torch.arange(100) % 10
      >>> ids = bridge_mr.data.Shards(num_clients=5, shards_per_client=2, seed=0)({"y": y})
      >>> [len(y[ids == c].unique()) for c in range(5)]  # two labels each
      [2, 2, 2, 2, 2]
      >>> ids = bridge_mr.data.Shards(num_clients=3, drop_remainder=True)({"y": y})
      >>> ids[ids >= 0].bincount()  # 6 shards of 16: 4 examples left out
      tensor([32, 32, 32])
    """

    num_clients: int
    shards_per_client: int = 2
    label: str = "y"
    shard_size: int | None = None
    seed: int = 0
    drop_remainder: bool = False

    def __post_init__(self) -> None:
        _check_count("Shards", "num_clients", self.num_clients)
        _check_count("Shards", "shards_per_client", self.shards_per_client)
        if self.shard_size is not None:
            _check_count("Shards", "shard_size", self.shard_size)
        _check_seed("Shards", self.seed)
        _check_drop_remainder("Shards", self.drop_remainder)
        if self.drop_remainder and self.shard_size is not None:
            raise ValueError(
                f"Shards(drop_remainder=True): sizes the shards from the examples, so expected "
                f"no shard_size, got shard_size={self.shard_size}. Fix: one of the two."
            )

    def __call__(self, examples: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The client id (in [0, num_clients); -1: left out) of each example, int64 [examples].

        Raises:
          ValueError: the label key is missing or not integer, or too few examples.
        """
        labels = _column("Shards", examples, self.label, "label")
        shards = self.num_clients * self.shards_per_client
        size = self.shard_size
        if self.drop_remainder:
            size = len(labels) // shards or None  # None: too few examples, refused below.
        needed = shards * (size or 1)
        if len(labels) < needed:
            smaller = "" if self.drop_remainder else ", or a smaller shard_size"
            raise ValueError(
                f"Shards: {self.num_clients} clients x {self.shards_per_client} shards of "
                f"{size or 'at least 1'} example(s) need {needed} examples, got "
                f"{len(labels)}. Fix: fewer clients or shards{smaller}."
            )
        rng = np.random.default_rng(self.seed)
        shuffled = rng.permutation(len(labels))[: needed if size else None]
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
