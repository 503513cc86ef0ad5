"""DP-FedAvg (user-level differential privacy) and its privacy accounting by dp-accounting."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr.torch_api import map_reduce
from bridge_mr.typing import AutoOrStrategy, PyTree

from ._local import LocalTraining
from ._rounds import Params, round_server, set_pseudo_gradient


@dataclasses.dataclass(frozen=True)
class _ClippedClient:
    """`local`'s result with the delta clipped to L2 norm `clip_norm` and scaled by the mask."""

    local: LocalTraining
    clip_norm: float

    def __call__(self, server: PyTree, client: tuple[PyTree, jax.Array]) -> dict[str, PyTree]:
        batches, mask = client
        out = self.local(server, batches)
        leaves = jax.tree.leaves(out["delta"])
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in leaves))
        # clip_norm / max(norm, clip_norm): exactly 1 for deltas within the norm.
        scale = mask * (self.clip_norm / jnp.maximum(norm, self.clip_norm))
        return {
            "delta": jax.tree.map(lambda leaf: leaf * scale, out["delta"]),
            "loss": out["loss"] * mask,
            "clipped": (norm > self.clip_norm).astype(mask.dtype) * mask,
            "clients": mask,
        }


def dp_outer_step(
    local: LocalTraining,
    params: Params,
    client_batches: PyTree,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_clients: float,
    generator: torch.Generator,
    mask: torch.Tensor | None = None,
    hparams: PyTree | None = None,
    strategy: AutoOrStrategy = "auto",
    chunk_size: int | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> dict[str, torch.Tensor]:
    """One DP-FedAvg round (McMahan et al., 2018): sets `.grad` to minus the noisy mean delta.

    Each client's delta (over the whole parameter pytree) is clipped to L2 norm `clip_norm`;
    the clipped deltas are summed (by `bridge_mr.map_reduce`); Gaussian noise of standard
    deviation `noise_multiplier * clip_norm` is added once to the sum, drawn from `generator`
    (one draw per parameter tensor, in `params` order, on the generator's device); the result
    is divided by `expected_clients` (the expected cohort size q * N, not the sampled count,
    as the privacy analysis requires). Step a server optimizer afterwards as with
    `outer_step`; report the privacy spent with `PrivacyAccountant`.

    Args:
      local: the client function, from `local_training`.
      params: the server's parameters, e.g. `dict(model.named_parameters())`.
      client_batches: a pytree of tensors shaped `[clients, steps, ...]`.
      clip_norm: the L2 norm C each client's delta is clipped to, > 0.
      noise_multiplier: z, the noise's standard deviation in units of C, >= 0.
      expected_clients: the expected cohort size the noisy sum is divided by, > 0
        (`ClientSampler.expected_cohort_size`).
      generator: the `torch.Generator` the noise comes from (you own its seed and state).
      mask: optional, 1 for real clients and 0 for padding rows (`Cohort.weights()`), shape
        `[clients]`; None: every row is a client.
      hparams, strategy, chunk_size, mesh: as for `outer_step`.

    Returns:
      `{"loss": the sampled clients' mean local loss, "clipped_fraction": the fraction of them
      whose delta was clipped, "clients": how many there were}` (0-d torch tensors).

    Raises:
      ValueError: `clip_norm`, `noise_multiplier` or `expected_clients` out of range, a bad
        `mask` shape, and what `outer_step` raises.
      TypeError: `generator` is not a torch.Generator.

    Example:
      >>> sampler = alg.ClientSampler(8, probability=0.5, generator=0)
      >>> server_opt = torch.optim.SGD(params.values(), lr=1.0)
      >>> noise = torch.Generator().manual_seed(1234)
      >>> cohort = sampler.sample()
      >>> metrics = alg.dp_outer_step(local, params, cohort.gather(batches), clip_norm=0.1,
      ...                             noise_multiplier=1.0, generator=noise,
      ...                             expected_clients=sampler.expected_cohort_size,
      ...                             mask=cohort.weights())
      >>> metrics["clients"], metrics["clipped_fraction"]  # 5 sampled, each delta clipped
      (tensor(5.), tensor(1.))
      >>> server_opt.step()
    """
    _positive("clip_norm", clip_norm, "e.g. clip_norm=0.1 (the L2 norm of a client's delta)")
    _positive("expected_clients", expected_clients, "e.g. sampler.expected_cohort_size")
    if (
        isinstance(noise_multiplier, bool)
        or not isinstance(noise_multiplier, int | float)
        or not noise_multiplier >= 0
    ):
        raise ValueError(
            f"dp_outer_step(noise_multiplier=...): expected a number >= 0, got "
            f"{noise_multiplier!r}."
        )
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "dp_outer_step(generator=...): expected a torch.Generator (the noise's source, e.g. "
            f"torch.Generator().manual_seed(0)), got {type(generator).__name__}."
        )
    server = round_server(local, params, client_batches, hparams, "dp_outer_step")
    first = jax.tree.leaves(client_batches)[0]
    n = int(first.shape[0])
    if mask is None:  # Batches as JAX arrays (data on the chip): a host mask, as cohorts give.
        mask = torch.ones(n, device=first.device if isinstance(first, torch.Tensor) else "cpu")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (n,):
        raise ValueError(
            f"dp_outer_step(mask=...): expected a tensor of shape [{n}] (one 0/1 per client "
            f"row), got {getattr(mask, 'shape', type(mask).__name__)}. Fix: cohort.weights()."
        )
    std = float(noise_multiplier) * float(clip_norm)
    with torch.no_grad():
        sums = map_reduce(
            _ClippedClient(local, float(clip_norm)),
            server,
            (client_batches, mask.to(torch.float32)),
            reduce="sum",
            mesh=mesh,
            strategy=strategy,
            chunk_size=chunk_size,
        )
        minus_noisy = {}  # Minus the noisy mean: divided by -m, the negation in the same op.
        for name in params:  # In `params` order (the reduced dict's keys come back sorted).
            total = sums["delta"][name]
            noise = torch.randn(
                total.shape, generator=generator, device=generator.device, dtype=torch.float32
            )
            noisy_sum = total + std * noise.to(total.device, total.dtype)
            minus_noisy[name] = noisy_sum / -expected_clients
        set_pseudo_gradient(params, minus_noisy)
    clients = sums["clients"]
    present = torch.clamp(clients, min=1.0)
    return {
        "loss": sums["loss"] / present,
        "clipped_fraction": sums["clipped"] / present,
        "clients": clients,
    }


def _positive(name: str, value: Any, fix: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value > 0 and math.isfinite(value))
    ):
        raise ValueError(
            f"dp_outer_step({name}=...): expected a finite number > 0, got {value!r}. Fix: {fix}."
        )


class PrivacyAccountant:
    """The (epsilon, delta) a DP-FedAvg run has spent, by the `dp-accounting` library.

    Each round is a Poisson-sampled Gaussian mechanism (`dp_accounting.PoissonSampledDpEvent`
    of a `GaussianDpEvent(noise_multiplier)`), composed over the rounds and converted to
    epsilon by dp-accounting's RDP or PLD accountant (add-or-remove-one neighbouring: one
    user's data in or out).

    Args:
      noise_multiplier: z, as given to `dp_outer_step`, > 0.
      sampling_probability: q, each client's chance per round, in (0, 1]
        (`ClientSampler.sampling_probability`).
      accountant: "rdp" (`dp_accounting.rdp.RdpAccountant`) or "pld"
        (`dp_accounting.pld.PLDAccountant`).

    Raises:
      ValueError: an argument out of range.
      ImportError: dp-accounting is not installed (`pip install bridge_mr[algorithms]`).

    Example:
      >>> accountant = alg.PrivacyAccountant(noise_multiplier=1.0, sampling_probability=0.01)
      >>> accountant.epsilon(delta=1e-5)  # before any round
      0.0
      >>> accountant.step()  # after each round
      >>> print(f"{accountant.epsilon(delta=1e-5):.2f}")
      0.96
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_probability: float,
        *,
        accountant: Literal["rdp", "pld"] = "rdp",
    ) -> None:
        if isinstance(noise_multiplier, bool) or not (
            isinstance(noise_multiplier, int | float) and noise_multiplier > 0
        ):
            raise ValueError(
                "PrivacyAccountant(noise_multiplier=...): expected a number > 0 (with no noise "
                f"no epsilon is finite), got {noise_multiplier!r}."
            )
        if isinstance(sampling_probability, bool) or not (
            isinstance(sampling_probability, int | float) and 0 < sampling_probability <= 1
        ):
            raise ValueError(
                "PrivacyAccountant(sampling_probability=...): expected a probability in (0, 1], "
                f"got {sampling_probability!r}. Fix: sampler.sampling_probability."
            )
        if accountant not in ("rdp", "pld"):
            raise ValueError(
                f"PrivacyAccountant(accountant=...): expected 'rdp' or 'pld', got {accountant!r}."
            )
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_probability = float(sampling_probability)
        self.accountant = accountant
        self.rounds = 0

    def step(self, rounds: int = 1) -> None:
        """Records `rounds` more rounds (>= 0).

        Args:
          rounds: how many rounds ran since the last call.

        Raises:
          ValueError: `rounds` is not an int >= 0.

        Example:
          >>> accountant = alg.PrivacyAccountant(noise_multiplier=1.0, sampling_probability=0.01)
          >>> accountant.step(rounds=100)
          >>> accountant.step()
          >>> accountant.rounds
          101
        """
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(
                f"PrivacyAccountant.step(rounds=...): expected an int >= 0, got {rounds!r}."
            )
        self.rounds += rounds

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at `delta` (0.0 before any round).

        Args:
          delta: the target delta, in (0, 1), e.g. 1 / (number of users) ** 1.1.

        Returns:
          dp-accounting's epsilon for the rounds recorded.

        Raises:
          ValueError: `delta` outside (0, 1).

        Example:
          >>> accountant = alg.PrivacyAccountant(noise_multiplier=1.0, sampling_probability=0.01)
          >>> accountant.step(rounds=100)
          >>> print(f"{accountant.epsilon(delta=1e-5):.2f}, {accountant.epsilon(delta=1e-6):.2f}")
          1.21, 1.51
        """
        if isinstance(delta, bool) or not (isinstance(delta, int | float) and 0 < delta < 1):
            raise ValueError(
                f"PrivacyAccountant.epsilon(delta=...): expected a number in (0, 1), got {delta!r}."
            )
        if self.rounds == 0:
            return 0.0
        import dp_accounting  # Takes seconds to import: loaded on first use.

        event = dp_accounting.PoissonSampledDpEvent(
            self.sampling_probability, dp_accounting.GaussianDpEvent(self.noise_multiplier)
        )
        accountant = (
            dp_accounting.rdp.RdpAccountant()
            if self.accountant == "rdp"
            else dp_accounting.pld.PLDAccountant()
        )
        accountant.compose(event, self.rounds)
        return float(accountant.get_epsilon(delta))
