"""Client sampling per round: uniform (a fixed cohort size) and Poisson, padded to few sizes."""

from __future__ import annotations

import dataclasses

import jax
import torch

from bridge_mr.typing import PyTree


@dataclasses.dataclass(frozen=True)
class Cohort:
    """The clients sampled for one round, and the padded size their tensors are gathered to.

    Padding keeps the number of compiled programs small: a Poisson cohort's size changes every
    round, but it is gathered to the next power of two (uniform cohorts have one size), and the
    padding rows get weight 0 (`weights()`), so they change no mean and no sum.

    Attributes:
      indices: the sampled clients, ascending (an int64 tensor of shape [size]).
      padded_size: the number of rows `gather` returns (>= size, >= 1).

    Example:
      >>> cohort = alg.Cohort(indices=torch.tensor([2, 5, 6]), padded_size=4)
      >>> cohort.size
      3
      >>> cohort.weights()  # the padding row weighs 0
      tensor([1., 1., 1., 0.])
    """

    indices: torch.Tensor
    padded_size: int

    @property
    def size(self) -> int:
        """How many clients were sampled (0 is possible with Poisson sampling)."""
        return int(self.indices.numel())

    def gather(self, data: PyTree) -> PyTree:
        """The sampled clients' rows of every leaf of `data`, padded to `padded_size` rows.

        Padding rows repeat client 0's row (weight 0 in `weights()`).

        Args:
          data: a pytree of tensors whose leading dimension is the client population.

        Returns:
          `data` with each leaf's leading dimension `padded_size`.

        Example:
          >>> cohort = alg.Cohort(torch.tensor([2, 5, 6]), padded_size=4)
          >>> cohort.gather(torch.arange(8) * 10)  # the padding row repeats client 0's
          tensor([20, 50, 60,  0])
          >>> cohort.gather(batches)["x"].shape  # [padded_size, steps, ...]
          torch.Size([4, 2, 4, 3])
        """
        pad = torch.zeros(self.padded_size - self.size, dtype=torch.int64)
        rows = torch.cat([self.indices, pad])
        return jax.tree.map(lambda leaf: leaf[rows.to(leaf.device)], data)

    def weights(self, example_counts: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row weights for the gathered cohort: 1 (or the example count), 0 for padding.

        Args:
          example_counts: optional, one count per client of the population (shape [N]).

        Returns:
          A float32 tensor of shape [padded_size].

        Example:
          >>> cohort = alg.Cohort(torch.tensor([2, 5, 6]), padded_size=4)
          >>> counts = torch.tensor([10, 20, 30, 40, 50, 60, 70, 80])  # examples per client
          >>> cohort.weights(counts)  # for outer_step(..., weights=cohort.weights(counts))
          tensor([30., 60., 70.,  0.])
        """
        real = torch.ones(self.size) if example_counts is None else example_counts[self.indices]
        pad = torch.zeros(self.padded_size - self.size)
        return torch.cat([real.to(torch.float32).cpu(), pad])


class ClientSampler:
    """Samples each round's cohort from a population of clients, from a generator you own.

    Exactly one of `cohort_size` (uniform: that many distinct clients, every subset equally
    likely) and `probability` (Poisson: each client independently with that probability, what
    DP accounting assumes) is given.

    Args:
      num_clients: the population size N, >= 1.
      cohort_size: uniform sampling's fixed cohort size, in [1, N].
      probability: Poisson sampling's per-client probability q, in (0, 1].
      generator: a `torch.Generator` (its state advances each round), or an int seed.

    Raises:
      ValueError: `num_clients`, `cohort_size` or `probability` out of range, or both / neither
        of `cohort_size` and `probability` given.
      TypeError: `generator` is neither a torch.Generator nor an int.

    Example:
      >>> sampler = alg.ClientSampler(8, probability=0.5, generator=0)  # or a torch.Generator
      >>> sampler.expected_cohort_size
      4.0
      >>> cohort = sampler.sample()
      >>> cohort
      Cohort(indices=tensor([0, 2, 3, 4, 6]), padded_size=8)
      >>> metrics = alg.outer_step(local, params, cohort.gather(batches), weights=cohort.weights())
    """

    def __init__(
        self,
        num_clients: int,
        *,
        cohort_size: int | None = None,
        probability: float | None = None,
        generator: torch.Generator | int,
    ) -> None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(
                f"ClientSampler(num_clients=...): expected an int >= 1, got {num_clients!r}."
            )
        if (cohort_size is None) == (probability is None):
            raise ValueError(
                "ClientSampler: expected exactly one of cohort_size= (uniform sampling) and "
                f"probability= (Poisson sampling), got cohort_size={cohort_size!r}, "
                f"probability={probability!r}."
            )
        if cohort_size is not None and (
            isinstance(cohort_size, bool)
            or not isinstance(cohort_size, int)
            or not 1 <= cohort_size <= num_clients
        ):
            raise ValueError(
                f"ClientSampler(cohort_size=...): expected an int in [1, num_clients={num_clients}]"
                f", got {cohort_size!r}."
            )
        if probability is not None and (
            isinstance(probability, bool)
            or not isinstance(probability, int | float)
            or not 0 < probability <= 1
        ):
            raise ValueError(
                "ClientSampler(probability=...): expected a sampling probability in (0, 1], got "
                f"{probability!r}. Fix: e.g. probability=cohort / num_clients."
            )
        if isinstance(generator, int) and not isinstance(generator, bool):
            generator = torch.Generator().manual_seed(generator)
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                "ClientSampler(generator=...): expected a torch.Generator or an int seed, got "
                f"{type(generator).__name__}."
            )
        self.num_clients = num_clients
        self.cohort_size = cohort_size
        self.probability = None if probability is None else float(probability)
        self.generator = generator

    @property
    def sampling_probability(self) -> float:
        """Each client's chance to be in a round's cohort (q; cohort_size / N if uniform)."""
        if self.probability is not None:
            return self.probability
        assert self.cohort_size is not None
        return self.cohort_size / self.num_clients

    @property
    def expected_cohort_size(self) -> float:
        """The mean cohort size, q * N (DP-FedAvg divides its noisy sum by it)."""
        return self.sampling_probability * self.num_clients

    def sample(self) -> Cohort:
        """Draws one round's cohort (advancing the generator).

        Returns:
          The `Cohort`: uniform cohorts are never padded; Poisson cohorts are padded to the
          next power of two of their size (1 for an empty cohort).

        Example:
          >>> sampler = alg.ClientSampler(8, cohort_size=3, generator=0)
          >>> sampler.sample()  # uniform: never padded
          Cohort(indices=tensor([0, 4, 7]), padded_size=3)
          >>> sampler.sample().size  # the generator advanced: another cohort, of the same size
          3
        """
        if self.cohort_size is not None:
            chosen = torch.randperm(self.num_clients, generator=self.generator)[: self.cohort_size]
            return Cohort(torch.sort(chosen).values, self.cohort_size)
        draws = torch.rand(self.num_clients, generator=self.generator)
        chosen = torch.nonzero(draws < self.sampling_probability).flatten()
        size = int(chosen.numel())
        return Cohort(chosen, 1 << max(size - 1, 0).bit_length())
