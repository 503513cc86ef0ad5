"""Federated training loops over any client implementation: FedSGD and FedAvg/FedOpt.

The loops are plain torch: the model is an `nn.Module`, a `torch.optim` optimizer updates it, and
the model and data may live on any device the client implementation supports.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Protocol, TypedDict

import torch
from torch import nn

from ._data import FederatedDigits, client_batches
from ._model import accuracy

Tensors = Mapping[str, torch.Tensor]


class LocalUpdate(TypedDict):
    """What the clients' local training returns: their mean delta and mean local loss."""

    delta: dict[str, torch.Tensor]
    loss: torch.Tensor


class Clients(Protocol):
    """How the clients' work is computed: by bridge_mr (`_clients`) or the torch baseline."""

    name: str

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to `params`."""
        ...

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and their mean local loss."""
        ...


@dataclasses.dataclass(frozen=True)
class _RoundsConfig:
    """What both loops draw their clients' batches by (`client_batches`)."""

    rounds: int = 60
    batch_size: int = 32
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class FedSGDConfig(_RoundsConfig):
    """FedSGD: each round, every client's batch gradient, averaged, steps a server Adam."""

    lr: float = 0.02


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(_RoundsConfig):
    """FedAvg/FedOpt: local SGD on each client, the mean delta applied by a server SGD.

    The clients' own learning rate belongs to the `Clients` implementation. `server_lr=1,
    server_momentum=0` is FedAvg; other values make it FedAvgM, a FedOpt.
    """

    local_steps: int = 10
    server_lr: float = 1.0
    server_momentum: float = 0.0


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    """One training run: per-round losses, final test accuracy and wall-clock times."""

    algorithm: str
    implementation: str
    losses: list[float]
    accuracy: float
    seconds: float
    first_round_seconds: float


class _RoundLog:
    """Collects per-round losses and timings, and shows them on a progress bar."""

    def __init__(
        self, rounds: int, algorithm: str, implementation: str, *, show_progress: bool
    ) -> None:
        self._algorithm = algorithm
        self._implementation = implementation
        self.losses: list[float] = []
        self.first_round_seconds = float("nan")
        self._bar = None
        if show_progress:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal.
            description = f"{algorithm} {implementation}"
            self._bar = tqdm(total=rounds, desc=description, unit="round", disable=None)
        self._start = time.perf_counter()

    def record(self, loss: float) -> None:
        """Logs the loss of the round that just finished."""
        if not self.losses:
            self.first_round_seconds = time.perf_counter() - self._start
        self.losses.append(loss)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update()

    def finish(self, model: nn.Module, data: FederatedDigits) -> PhaseResult:
        """Closes the bar; returns the run, timed since the log was created, and its accuracy."""
        seconds = time.perf_counter() - self._start
        if self._bar is not None:
            self._bar.close()
        return PhaseResult(
            algorithm=self._algorithm,
            implementation=self._implementation,
            losses=self.losses,
            accuracy=accuracy(model, data.test_x, data.test_y),
            seconds=seconds,
            first_round_seconds=self.first_round_seconds,
        )


def train_fedsgd(
    model: nn.Module,
    data: FederatedDigits,
    clients: Clients,
    config: FedSGDConfig,
    *,
    show_progress: bool = True,
) -> PhaseResult:
    """Trains `model` in place with FedSGD; the loss is the clients' mean batch loss."""
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    log = _RoundLog(config.rounds, "FedSGD", clients.name, show_progress=show_progress)
    for batch in client_batches(
        data, rounds=config.rounds, batch_size=config.batch_size, seed=config.seed
    ):
        optimizer.zero_grad()
        loss = clients.mean_loss(params, batch)
        loss.backward()
        optimizer.step()
        log.record(loss.item())
    return log.finish(model, data)


def train_fedavg(
    model: nn.Module,
    data: FederatedDigits,
    clients: Clients,
    config: FedAvgConfig,
    *,
    show_progress: bool = True,
) -> PhaseResult:
    """Trains `model` in place with FedAvg/FedOpt: the mean client delta is a pseudo-gradient.

    The clients' local training runs under `torch.no_grad()`: nothing flows back through it.
    """
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.server_lr, momentum=config.server_momentum
    )
    log = _RoundLog(config.rounds, "FedAvg", clients.name, show_progress=show_progress)
    for batches in client_batches(
        data,
        rounds=config.rounds,
        batch_size=config.batch_size,
        local_steps=config.local_steps,
        seed=config.seed,
    ):
        with torch.no_grad():
            update = clients.mean_local_update(dict(model.named_parameters()), batches)
        for name, p in model.named_parameters():
            p.grad = -update["delta"][name]
        optimizer.step()
        log.record(update["loss"].item())
    return log.finish(model, data)
