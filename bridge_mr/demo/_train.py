"""Federated training loops over any client implementation: FedSGD and FedAvg/FedOpt.

The loops are plain torch: the model is an `nn.Module`, a `torch.optim` optimizer updates it, and
the model and data may live on any device the client implementation supports. `train` runs
several implementations side by side, round by round on the same batches, and times each round.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypedDict

import torch
from torch import nn

from ._machine import OtherProcessesCPU
from ._model import accuracy

Tensors = Mapping[str, torch.Tensor]


class LocalUpdate(TypedDict):
    """What the clients' local training returns: their mean delta and mean local loss."""

    delta: dict[str, torch.Tensor]
    loss: torch.Tensor


class Clients(Protocol):
    """How the clients' work is computed: by bridge_mr (`_clients`) or a torch baseline."""

    name: str

    def mean_loss(self, params: Tensors, batch: Tensors) -> torch.Tensor:
        """The clients' mean loss; differentiable with respect to `params`."""
        ...

    def mean_local_update(self, params: Tensors, batches: Tensors) -> LocalUpdate:
        """The clients' mean local-SGD delta and their mean local loss."""
        ...


@dataclasses.dataclass(frozen=True)
class _RoundsConfig:
    """What both loops draw their clients' batches by (`bridge_mr.data.rounds`)."""

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
    """One training run: per-round losses and times, and the final test accuracy.

    `round_seconds[0]` is the first round, which includes whatever the implementation does on
    its first call (bridge_mr: tracing, XLA compilation, `strategy="auto"`'s choice).
    `other_cpu` is the CPU other processes used while the run's rounds were timed, in cores
    (None where the platform does not tell).
    """

    algorithm: str
    implementation: str
    losses: list[float]
    accuracy: float
    round_seconds: list[float]
    other_cpu: float | None = None

    @property
    def seconds(self) -> float:
        """All rounds together."""
        return sum(self.round_seconds)

    @property
    def first_round_seconds(self) -> float:
        """The first round, first-call costs included."""
        return self.round_seconds[0]

    @property
    def later_round_seconds(self) -> float:
        """The median of the rounds after the first (the first round when there is no other)."""
        return statistics.median(self.round_seconds[1:] or self.round_seconds)

    @property
    def rounds_per_second(self) -> float:
        """Later rounds per second: 1 / `later_round_seconds`."""
        return 1.0 / self.later_round_seconds


Step = Callable[[Tensors], float]  # Runs one round on its batch; returns the round's loss.


def fedsgd_step(model: nn.Module, clients: Clients, config: FedSGDConfig) -> Step:
    """One FedSGD round of `model` per call: the clients' mean batch loss steps a server Adam."""
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)

    def step(batch: Tensors) -> float:
        optimizer.zero_grad()
        loss = clients.mean_loss(params, batch)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def fedavg_step(model: nn.Module, clients: Clients, config: FedAvgConfig) -> Step:
    """One FedAvg/FedOpt round of `model` per call: the mean client delta is a pseudo-gradient.

    The clients' local training runs under `torch.no_grad()`: nothing flows back through it.
    """
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.server_lr, momentum=config.server_momentum
    )

    def step(batches: Tensors) -> float:
        with torch.no_grad():
            update = clients.mean_local_update(dict(model.named_parameters()), batches)
        for name, p in model.named_parameters():
            p.grad = -update["delta"][name]
        optimizer.step()
        return update["loss"].item()

    return step


@dataclasses.dataclass(frozen=True)
class Run:
    """One implementation's training: its model, its name, and its round function."""

    model: nn.Module
    implementation: str
    step: Step


def train(
    algorithm: str,
    runs: Sequence[Run],
    batches: Iterable[Tensors],
    test: Tensors,
    *,
    rounds: int,
    show_progress: bool = True,
) -> list[PhaseResult]:
    """Trains every run on the same batches, interleaved round by round, timing each round.

    Round r starts with run r mod len(runs), so no implementation always runs first (right
    after the batch is drawn) or last. A round's time covers its step only, `.item()` of the
    loss included (which waits for the round's result), not the drawing of the batch.

    Args:
      algorithm: the name the results carry ("FedSGD", "FedAvg").
      runs: the implementations' models and round functions.
      batches: one batch per round, shared by every run.
      test: the held-out split ({"x", "y"}), for each model's accuracy after the last round.
      rounds: how many batches `batches` yields (the progress bar's length).
      show_progress: a progress bar (on stderr, when it is a terminal).

    Returns:
      One result per run, in the order of `runs`.
    """
    losses: list[list[float]] = [[] for _ in runs]
    seconds: list[list[float]] = [[] for _ in runs]
    bar = None
    if show_progress:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal.
        bar = tqdm(total=rounds, desc=algorithm, unit="round", disable=None)
    others = OtherProcessesCPU()
    for index, batch in enumerate(batches):
        for offset in range(len(runs)):
            which = (index + offset) % len(runs)
            start = time.perf_counter()
            loss = runs[which].step(batch)
            seconds[which].append(time.perf_counter() - start)
            losses[which].append(loss)
        if bar is not None:
            bar.update()
    other_cpu = others.cores()
    if bar is not None:
        bar.close()
    return [
        PhaseResult(
            algorithm=algorithm,
            implementation=run.implementation,
            losses=losses[i],
            accuracy=accuracy(run.model, test["x"], test["y"]),
            round_seconds=seconds[i],
            other_cpu=other_cpu,
        )
        for i, run in enumerate(runs)
    ]
