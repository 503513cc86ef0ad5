"""A federated dataset: examples on the round's device, grouped by client, and its rounds."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
import torch

from bridge_mr.algorithms import ClientSampler, Cohort

from . import _on_jax
from ._rounds import Round, round_index, round_steps

Examples: TypeAlias = Mapping[str, torch.Tensor]
Partitioner: TypeAlias = Callable[[Examples], torch.Tensor]
MASK = "mask"


def _check_examples(owner: str, examples: Any, *, jax_arrays: bool = False) -> dict[str, Any]:
    """`examples` as a dict of tensors (or, with `jax_arrays`, of JAX arrays on one device) with
    one leading example dimension, or a clear error."""
    if not isinstance(examples, Mapping) or not examples:
        raise TypeError(
            f"{owner}: expected a non-empty mapping from field names to tensors, e.g. "
            f'{{"x": images, "y": labels}}, got {type(examples).__name__}.'
        )
    fields: dict[str, Any] = {}
    for name, value in examples.items():
        if not isinstance(name, str) or name == MASK:
            raise ValueError(
                f"{owner}: expected field names that are strings other than {MASK!r} (the "
                f"round's padding mask takes that name), got {name!r}. Fix: rename the field."
            )
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if _on_jax.is_array(value) and not jax_arrays:
            raise TypeError(
                f"{owner}: field {name!r} is a JAX array; a dataset is built from torch tensors "
                "(or numpy arrays). Fix: build it from tensors, then FederatedDataset.to("
                "jax_device) puts the examples on that device as JAX arrays."
            )
        if not isinstance(value, torch.Tensor | jax.Array) or value.ndim == 0:
            raise TypeError(
                f"{owner}: expected field {name!r} to be a tensor (or a JAX array) with a "
                f"leading example dimension, got {type(value).__name__} of shape "
                f"{list(getattr(value, 'shape', ()))}."
            )
        fields[name] = value
    _on_jax.check_one_place(owner, fields)
    sizes = {name: int(value.shape[0]) for name, value in fields.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"{owner}: expected every field to hold the same number of examples (leading "
            f"dimension), got {sizes}."
        )
    return fields


class FederatedDataset:
    """Examples grouped by client, resident on one device, and the batches of each round.

    The examples are kept sorted by client (client `i` holds rows `offsets[i]:offsets[i+1]`),
    on the device the rounds run on (CPU, CUDA, torch-xla or TorchTPU's "tpu", or a JAX device:
    `to`); the client bookkeeping stays on the host. `round()` draws a round's `[clients,
    steps, batch_size, ...]` batches with one index computation on the host and one gather per
    field on the device: no Python loop over the clients. Build it with `from_tensors`,
    `from_dataset` or `from_clients`.

    Attributes:
      examples: the fields, each `[examples, ...]`, sorted by client: torch tensors, or JAX
        arrays on one JAX device (`to(jax_device)`).
      offsets: `[num_clients + 1]` int64 (host): where each client's examples start and end.
      client_keys: each client's key: its `from_clients` key, else its index.

    Raises:
      TypeError: `examples` is not a mapping of tensors.
      ValueError: bad `offsets` or `client_keys`, or a client without examples.

    Example:
      >>> x, y = torch.randn(100, 4), torch.arange(100) % 10
      >>> train = bridge_mr.data.FederatedDataset.from_tensors(
      ...     {"x": x, "y": y}, bridge_mr.data.Shards(num_clients=5, seed=0))
      >>> train.num_clients, train.example_counts
      (5, tensor([20, 20, 20, 20, 20]))
      >>> sampler = train.sampler(cohort_size=2, generator=0)
      >>> rnd = train.round(sampler.sample(), batch_size=8, epochs=1,
      ...                   generator=torch.Generator().manual_seed(1))
      >>> rnd.batches["x"].shape, rnd.batches["mask"].shape  # 20 examples: 3 steps of 8
      (torch.Size([2, 3, 8, 4]), torch.Size([2, 3, 8]))
    """

    def __init__(
        self,
        examples: Mapping[str, Any],
        offsets: torch.Tensor,
        client_keys: Sequence[Hashable] | None = None,
    ) -> None:
        self.examples = _check_examples("FederatedDataset(examples=...)", examples, jax_arrays=True)
        offsets = offsets.to("cpu", torch.int64)
        total = len(next(iter(self.examples.values())))
        if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(
                f"FederatedDataset(offsets=...): expected [num_clients + 1] offsets from 0 to "
                f"the {total} examples, got {offsets.tolist()}. Fix: build the dataset with "
                "from_tensors, from_dataset or from_clients."
            )
        counts = offsets.diff()
        if (counts < 1).any():
            client = int(torch.nonzero(counts < 1).flatten()[0])
            raise ValueError(
                f"FederatedDataset: expected every client to hold at least one example, got "
                f"client {client} (of {len(counts)}) with none. Fix: drop empty clients, or give "
                "the partitioner fewer clients (e.g. Dirichlet(..., min_examples=1))."
            )
        self.offsets = offsets
        keys = tuple(range(len(counts))) if client_keys is None else tuple(client_keys)
        if len(keys) != len(counts):
            raise ValueError(
                f"FederatedDataset(client_keys=...): expected one key per client ({len(counts)}),"
                f" got {len(keys)}."
            )
        self.client_keys = keys

    @classmethod
    def from_tensors(
        cls,
        examples: Examples,
        client_ids: torch.Tensor | Partitioner,
        *,
        device: torch.device | str | None = None,
    ) -> FederatedDataset:
        """A dataset from tensors of all examples and each example's client.

        Args:
          examples: field name -> tensor `[examples, ...]` (numpy arrays are taken too).
          client_ids: each example's client, an integer tensor `[examples]` with values in
            `[0, num_clients)` (every client holding at least one example; -1: the example is
            left out), or a partitioner (`IID`, `Dirichlet`, `Shards`, `NaturalKey`: a
            function of `examples` giving one).
          device: where the examples live for the rounds; None keeps their device.

        Returns:
          The dataset, its examples sorted by client (one gather) on `device`.

        Raises:
          TypeError: `examples` is not a mapping of tensors.
          ValueError: fields of different lengths, a bad `client_ids`, or an empty client.

        Example:
          >>> examples = {"x": torch.arange(6.0), "y": torch.tensor([0, 1, 0, 1, 0, 1])}
          >>> train = bridge_mr.data.FederatedDataset.from_tensors(
          ...     examples, client_ids=torch.tensor([1, 0, 1, 1, 0, 2]))
          >>> train.example_counts, train.client(0)["x"]
          (tensor([2, 3, 1]), tensor([1., 4.]))
        """
        fields = _check_examples("FederatedDataset.from_tensors(examples=...)", examples)
        if not isinstance(client_ids, torch.Tensor) and callable(client_ids):
            client_ids = client_ids(fields)
        if isinstance(client_ids, np.ndarray):
            client_ids = torch.from_numpy(client_ids)
        total = len(next(iter(fields.values())))
        if (
            not isinstance(client_ids, torch.Tensor)
            or client_ids.shape != (total,)
            or client_ids.dtype.is_floating_point
            or client_ids.dtype in (torch.bool, torch.complex64, torch.complex128)
            or (total and int(client_ids.min()) < -1)
        ):
            raise ValueError(
                f"FederatedDataset.from_tensors(client_ids=...): expected one client id >= 0 "
                f"(or -1: in no client) per example, an integer tensor of shape [{total}], or a "
                "partitioner, got "
                f"{getattr(client_ids, 'dtype', type(client_ids).__name__)} of shape "
                f"{list(getattr(client_ids, 'shape', ()))}. Fix: e.g. bridge_mr.data.IID(10)."
            )
        ids = client_ids.to("cpu", torch.int64)
        kept = torch.nonzero(ids >= 0).flatten()
        order = kept[torch.argsort(ids[kept], stable=True)]
        counts = torch.bincount(ids[kept])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        target = {name: device or value.device for name, value in fields.items()}
        sorted_fields = {
            name: value.to(target[name])[order.to(target[name])] for name, value in fields.items()
        }
        return cls(sorted_fields, offsets)

    @classmethod
    def from_dataset(
        cls,
        dataset: torch.utils.data.Dataset[Any],
        client_ids: torch.Tensor | Partitioner,
        *,
        names: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ) -> FederatedDataset:
        """A dataset from a map-style `torch.utils.data.Dataset`, each item read once.

        Items are tuples (named by `names`) or dicts of tensors, numbers or numpy arrays; each
        field is stacked into one tensor and then placed as `from_tensors` does.

        Args:
          dataset: a map-style dataset (`len()` and integer indexing), e.g. a torchvision one.
          client_ids: as for `from_tensors`.
          names: the field names of tuple items, e.g. `("x", "y")` for (image, label).
          device: as for `from_tensors`.

        Returns:
          The dataset.

        Raises:
          TypeError: a tuple item without `names`, or an item of another kind.
          ValueError: as `from_tensors`, or a dataset of no items.

        Example:
          >>> pairs = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.arange(12) % 3)
          >>> train = bridge_mr.data.FederatedDataset.from_dataset(
          ...     pairs, bridge_mr.data.IID(num_clients=4, seed=0), names=("x", "y"))
          >>> train.examples["x"].shape, train.example_counts
          (torch.Size([12, 3]), tensor([3, 3, 3, 3]))
        """
        if len(dataset) == 0:  # pyright: ignore[reportArgumentType]
            raise ValueError(
                "FederatedDataset.from_dataset(dataset=...): expected items, got none."
            )
        columns: dict[str, list[Any]] = {}
        for i in range(len(dataset)):  # pyright: ignore[reportArgumentType]
            item = dataset[i]
            if isinstance(item, Mapping):
                fields = dict(item)
            elif isinstance(item, tuple | list) and names is not None and len(names) == len(item):
                fields = dict(zip(names, item, strict=True))
            else:
                raise TypeError(
                    f"FederatedDataset.from_dataset: item {i} is a {type(item).__name__} of "
                    f"{len(item) if isinstance(item, tuple | list) else 1} part(s) and names="
                    f"{names!r}. Fix: names=(...) with one name per part of a tuple item, or "
                    "items that are dicts."
                )
            for name, value in fields.items():
                columns.setdefault(name, []).append(torch.as_tensor(value))
        stacked = {name: torch.stack(values) for name, values in columns.items()}
        return cls.from_tensors(stacked, client_ids, device=device)

    @classmethod
    def from_clients(
        cls, clients: Mapping[Any, Examples], *, device: torch.device | str | None = None
    ) -> FederatedDataset:
        """A dataset from each client's own tensors, keyed by client (e.g. a user id).

        Args:
          clients: client key -> that client's fields (the same names everywhere).
          device: as for `from_tensors`.

        Returns:
          The dataset; client `i` is the `i`-th key of `clients` (`client_keys`).

        Raises:
          ValueError: no clients, an empty client, or clients with different field names.

        Example:
          >>> train = bridge_mr.data.FederatedDataset.from_clients(
          ...     {"ann": {"x": torch.ones(2, 3)}, "bob": {"x": torch.zeros(5, 3)}})
          >>> train.client_keys, train.example_counts
          (('ann', 'bob'), tensor([2, 5]))
        """
        if not isinstance(clients, Mapping) or not clients:
            raise ValueError(
                "FederatedDataset.from_clients(clients=...): expected a non-empty mapping from "
                f"client keys to dicts of tensors, got {type(clients).__name__}."
            )
        parts = {
            key: _check_examples(f"FederatedDataset.from_clients: client {key!r}", fields)
            for key, fields in clients.items()
        }
        first_key, first = next(iter(parts.items()))
        for key, fields in parts.items():
            if fields.keys() != first.keys():
                raise ValueError(
                    f"FederatedDataset.from_clients: expected every client to have the fields "
                    f"{sorted(first)} (as {first_key!r}), got {sorted(fields)} for {key!r}."
                )
        stacked = {
            name: torch.cat([fields[name] for fields in parts.values()]).to(
                device or first[name].device
            )
            for name in first
        }
        counts = torch.tensor([len(next(iter(f.values()))) for f in parts.values()])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        return cls(stacked, offsets, client_keys=list(parts))

    @property
    def num_clients(self) -> int:
        """How many clients the dataset has."""
        return len(self.offsets) - 1

    @property
    def example_counts(self) -> torch.Tensor:
        """Each client's number of examples, an int64 tensor `[num_clients]` on the host."""
        return self.offsets.diff()

    def client(self, index: int) -> dict[str, Any]:
        """Client `index`'s examples, in the dataset's order (views, on the dataset's device).

        For a dataset on a JAX device (`to(jax_device)`) they are JAX arrays there.

        Args:
          index: the client, in `[0, num_clients)`.

        Returns:
          Its fields, each `[its examples, ...]`.

        Raises:
          IndexError: `index` out of range.

        Example:
          >>> train = bridge_mr.data.FederatedDataset.from_clients(
          ...     {"a": {"x": torch.ones(2)}, "b": {"x": torch.zeros(3)}})
          >>> train.client(1)
          {'x': tensor([0., 0., 0.])}
        """
        if not 0 <= index < self.num_clients:
            raise IndexError(
                f"FederatedDataset.client(index=...): expected an index in [0, "
                f"{self.num_clients}), got {index!r}."
            )
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return {name: value[start:stop] for name, value in self.examples.items()}

    def to(self, device: Any) -> FederatedDataset:
        """The same dataset with its examples on `device` (the bookkeeping stays on the host).

        A JAX device (a TPU, with a CPU build of torch) holds the examples as JAX arrays:
        `round()` then gathers there and returns JAX arrays, which `map_reduce` (and
        `algorithms`) take as inputs already where the program runs, so that per round only
        the example index and mask go to the device (and the parameters, as torch tensors).
        With x64 off, int64 fields become int32 (values checked).

        Args:
          device: e.g. "cuda", `torch_xla.device()`, or a JAX device such as
            `jax.devices("tpu")[0]` (or `bridge_mr.dlpack.host_program_device()`).

        Returns:
          A new dataset (this one is unchanged).

        Raises:
          TypeError: a float64 field bound for a JAX device with x64 off.
          ValueError: an int64 field out of int32's range bound for a JAX device (x64 off).

        Example:
          >>> train = bridge_mr.data.FederatedDataset.from_clients({"a": {"x": torch.ones(2)}})
          >>> train.to("cpu").examples["x"].device
          device(type='cpu')
          >>> train.to(jax.devices()[0]).examples["x"]  # on a TPU host: on the chip
          Array([1., 1.], dtype=float32)
        """
        if isinstance(device, jax.Device):
            moved = _on_jax.to_device("FederatedDataset.to(device=...)", self.examples, device)
            return FederatedDataset(moved, self.offsets, self.client_keys)
        if any(_on_jax.is_array(v) for v in self.examples.values()):
            raise TypeError(
                f"FederatedDataset.to(device={device!r}): the examples are JAX arrays; a torch "
                "device takes torch tensors. Fix: build the dataset again from the tensors, or "
                "pass a JAX device."
            )
        moved = {name: value.to(device) for name, value in self.examples.items()}
        return FederatedDataset(moved, self.offsets, self.client_keys)

    def sampler(
        self,
        *,
        cohort_size: int | None = None,
        probability: float | None = None,
        generator: torch.Generator | int,
    ) -> ClientSampler:
        """A `bridge_mr.algorithms.ClientSampler` of this dataset's clients.

        Args:
          cohort_size: uniform sampling without replacement of that many clients per round.
          probability: Poisson sampling, each client independently (DP-FedAvg's assumption).
          generator: a `torch.Generator` or an int seed (see `ClientSampler`).

        Returns:
          The sampler; its `sample()` is a `Cohort` to give `round()`.

        Raises:
          ValueError: as `ClientSampler`.

        Example:
          >>> train = bridge_mr.data.FederatedDataset.from_tensors(
          ...     {"x": torch.arange(8.0)}, torch.arange(8) % 4)
          >>> train.sampler(probability=0.5, generator=0).expected_cohort_size
          2.0
        """
        return ClientSampler(
            self.num_clients, cohort_size=cohort_size, probability=probability, generator=generator
        )

    def round(
        self,
        cohort: Cohort | None = None,
        *,
        batch_size: int,
        steps: int | None = None,
        epochs: int | None = None,
        padding: bool = True,
        generator: torch.Generator,
    ) -> Round:
        """One round's batches for `cohort`'s clients: `[clients, steps, batch_size, ...]`.

        Each client fills its `steps * batch_size` slots with passes over its examples, one
        after the other, each in a fresh random order (TFF's `repeat(E).batch(B)`): with
        `steps=S` alone, one pass (a client holding more examples gives a random subset; one
        holding fewer is padded); with `epochs=E` alone, E passes, the step count set by the
        largest client of the dataset, `ceil(E * max_count / batch_size)`, so every round
        compiles to one program; with both, E passes cut to (or padded up to) S steps
        (`repeat(E).batch(B).take(S)`). Padding slots repeat the client's first example with
        mask 0 (see `Round`); a cohort's padding rows are all padding.

        Args:
          cohort: the round's clients (`sampler().sample()`); None: every client.
          batch_size: examples per local step, >= 1.
          steps: local steps per round.
          epochs: passes over each client's data (default 1 when `steps` is given).
          padding: False refuses any padding slot in a client's rows: every client must fill
            its slots.
          generator: the `torch.Generator` the example orders come from (yours: create it once
            with a seed; its state advances every round).

        Returns:
          The `Round`: its `batches` go to `outer_step`, `mean_delta`, `dp_outer_step` or
          `bridge_mr.map_reduce`, with `weights=rnd.weights` or `mask=rnd.client_mask`.

        Raises:
          ValueError: neither `steps` nor `epochs`; a count < 1; with
            `padding=False`, a client that cannot fill its slots; cohort clients out of range.
          TypeError: `generator` is not a torch.Generator, `cohort` not a Cohort.

        Example:
          >>> train = bridge_mr.data.FederatedDataset.from_tensors(
          ...     {"x": torch.randn(30, 3)}, torch.arange(30) % 3)  # 10 examples each
          >>> g = torch.Generator().manual_seed(0)
          >>> train.round(batch_size=4, steps=2, generator=g).batches["x"].shape
          torch.Size([3, 2, 4, 3])
          >>> train.round(batch_size=4, epochs=1, generator=g).batches["mask"][0]
          tensor([[1., 1., 1., 1.],
                  [1., 1., 1., 1.],
                  [1., 1., 0., 0.]])
        """
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                "FederatedDataset.round(generator=...): expected a torch.Generator, created "
                "once and passed every round (its state advances), e.g. "
                f"torch.Generator().manual_seed(0); got {type(generator).__name__}."
            )
        if cohort is None:
            cohort = Cohort(torch.arange(self.num_clients), self.num_clients)
        if not isinstance(cohort, Cohort):
            raise TypeError(
                f"FederatedDataset.round(cohort=...): expected a bridge_mr.algorithms.Cohort "
                f"(from sampler().sample()) or None, got {type(cohort).__name__}."
            )
        if cohort.size and not 0 <= int(cohort.indices.min()) <= int(cohort.indices.max()) < (
            self.num_clients
        ):
            raise ValueError(
                f"FederatedDataset.round(cohort=...): expected client indices in [0, "
                f"{self.num_clients}), got {cohort.indices.tolist()}."
            )
        counts = self.example_counts
        steps, passes = round_steps(counts, batch_size, steps, epochs, padding)
        pad = torch.full((cohort.padded_size - cohort.size,), -1, dtype=torch.int64)
        rows = torch.cat([cohort.indices.to("cpu", torch.int64), pad])
        index, mask = round_index(
            rows, self.offsets[:-1], counts, steps * batch_size, passes, generator
        )
        shape = (len(rows), steps, batch_size)
        index = index.flatten()
        if _on_jax.is_array(next(iter(self.examples.values()))):
            on_jax = _on_jax.gather(self.examples, index, mask, shape)
            return Round(on_jax, cohort, cohort.weights(counts), cohort.weights())
        batches: dict[str, torch.Tensor] = {}
        on_device: dict[torch.device, torch.Tensor] = {}
        for name, value in self.examples.items():
            if value.device not in on_device:
                on_device[value.device] = index.to(value.device)
            # index_select: on CPU several times faster than the same advanced indexing.
            gathered = torch.index_select(value, 0, on_device[value.device])
            batches[name] = gathered.view(*shape, *value.shape[1:])
        first = next(iter(self.examples.values()))
        batches[MASK] = mask.view(shape).to(first.device)
        weights = cohort.weights(counts).to(first.device)
        return Round(batches, cohort, weights, cohort.weights().to(first.device))
