"""The demo run: FedSGD and FedAvg with bridge_mr and with the torch baseline, side by side."""

from __future__ import annotations

import copy
import dataclasses
import platform
import time
from collections.abc import Callable

import jax
import torch

from ._baseline import TorchFuncClients
from ._clients import BridgeClients
from ._data import N_CLASSES, load_federated_digits
from ._model import MLP
from ._train import (
    Clients,
    FedAvgConfig,
    FedSGDConfig,
    PhaseResult,
    train_fedavg,
    train_fedsgd,
)

LOCAL_LR = 0.3


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What to run: the number of clients, rounds per algorithm, the seed, the baseline."""

    clients: int = 16
    rounds: int = 60
    seed: int = 0
    baseline: bool = True


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """Every training run of the demo, and the wall time of the whole demo."""

    phases: list[PhaseResult]
    seconds: float

    def phase(self, algorithm: str, implementation: str) -> PhaseResult:
        """The run of `algorithm` ("FedSGD", "FedAvg") by `implementation`."""
        for result in self.phases:
            if (result.algorithm, result.implementation) == (algorithm, implementation):
                return result
        raise KeyError(f"no {algorithm} run by {implementation} in this demo result")


def run_demo(
    config: DemoConfig, *, show_progress: bool = True, echo: Callable[[str], None] = print
) -> DemoResult:
    """Trains the same initial MLP with FedSGD and FedAvg, by bridge_mr and the baseline.

    Prints (through `echo`) a header, one summary line per training run and a final table.

    Args:
      config: clients, rounds per algorithm, seed, and whether to run the torch baseline.
      show_progress: a progress bar per training run (on stderr, when it is a terminal).
      echo: where the printed lines go.

    Returns:
      Every training run (FedSGD, then FedAvg; bridge_mr, then the baseline) and the time.

    Raises:
      ValueError: `config.clients` is not between 1 and 718 (two non-empty shards each).
    """
    start = time.perf_counter()
    data = load_federated_digits(config.clients, seed=config.seed)
    torch.manual_seed(config.seed)
    initial = MLP()
    batch_size = min(32, data.per_client)
    fedsgd = FedSGDConfig(rounds=config.rounds, batch_size=batch_size, seed=config.seed)
    fedavg = FedAvgConfig(rounds=config.rounds, batch_size=batch_size, seed=config.seed)
    n_params = sum(p.numel() for p in initial.parameters())
    digits = (torch.nn.functional.one_hot(data.client_y, N_CLASSES).sum(dim=1) > 0).sum(dim=-1)
    fewest, most = int(digits.min()), int(digits.max())
    echo(
        f"data: scikit-learn digits, {data.n_clients} clients x {data.per_client} examples "
        f"(label-skewed: 2 label-sorted shards each, so each client holds "
        f"{fewest if fewest == most else f'{fewest} to {most}'} of the 10 digits), "
        f"{len(data.test_y)} held-out test examples"
    )
    echo(
        f"model: MLP 64-64-10 ({n_params:,} parameters), written once in torch: bridge_mr "
        f"runs its client loss as JAX operations (bridge_mr.from_torch), the baseline with "
        f"torch.func; torch {torch.__version__}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform} ({platform.machine()}), {torch.get_num_threads()} torch "
        f"threads"
    )
    echo(
        f"FedSGD: {fedsgd.rounds} rounds; each client's loss on {batch_size} examples, "
        f"mean over clients, loss.backward(), Adam(lr={fedsgd.lr}) on the server"
    )
    echo(
        f"FedAvg: {fedavg.rounds} rounds; each client runs {fedavg.local_steps} SGD steps "
        f"(lr={LOCAL_LR}, batch {batch_size}), the mean delta is the server's pseudo-gradient "
        f"for SGD(lr={fedavg.server_lr})"
    )

    implementations: list[Callable[[torch.nn.Module], Clients]] = [
        lambda model: BridgeClients(model, local_lr=LOCAL_LR)
    ]
    if config.baseline:
        implementations.append(lambda model: TorchFuncClients(model, local_lr=LOCAL_LR))
    trainers: list[Callable[[torch.nn.Module, Clients], PhaseResult]] = [
        lambda model, clients: train_fedsgd(
            model, data, clients, fedsgd, show_progress=show_progress
        ),
        lambda model, clients: train_fedavg(
            model, data, clients, fedavg, show_progress=show_progress
        ),
    ]
    phases = []
    for train in trainers:
        for make_clients in implementations:
            model = copy.deepcopy(initial)
            clients = make_clients(model)
            result = train(model, clients)
            echo(
                f"  {result.algorithm} {clients.name:<10} test accuracy {result.accuracy:6.1%}  "
                f"final loss {result.losses[-1]:.4f}  {result.seconds:6.2f} s"
            )
            phases.append(result)
    result = DemoResult(phases=phases, seconds=time.perf_counter() - start)
    echo("")
    echo(format_table(result))
    return result


def fedsgd_loss_gap(result: DemoResult) -> float:
    """The largest per-round FedSGD loss difference between bridge_mr and the baseline."""
    ours = result.phase("FedSGD", BridgeClients.name).losses
    theirs = result.phase("FedSGD", TorchFuncClients.name).losses
    return max(abs(a - b) for a, b in zip(ours, theirs, strict=True))


def format_table(result: DemoResult) -> str:
    """The runs side by side: accuracy, final loss, wall time, first round, later rounds."""
    header = (
        f"{'algorithm':<9}  {'implementation':<14}  {'rounds':>6}  {'test acc':>8}  "
        f"{'final loss':>10}  {'time':>8}  {'1st round':>9}  {'per later round':>15}"
    )
    lines = [header, "-" * len(header)]
    for phase in result.phases:
        rounds = len(phase.losses)
        later = (phase.seconds - phase.first_round_seconds) / max(rounds - 1, 1)
        lines.append(
            f"{phase.algorithm:<9}  {phase.implementation:<14}  {rounds:>6}  "
            f"{phase.accuracy:>8.1%}  {phase.losses[-1]:>10.4f}  {phase.seconds:>6.2f} s  "
            f"{phase.first_round_seconds:>7.2f} s  {later * 1e3:>12.1f} ms"
        )
    lines.append("(1st round includes tracing and XLA compilation for bridge_mr)")
    implementations = {phase.implementation for phase in result.phases}
    if TorchFuncClients.name in implementations:
        lines.append(
            "FedSGD losses, bridge_mr vs torch.func (same init, same data): largest per-round "
            f"difference {fedsgd_loss_gap(result):.1e}"
        )
    return "\n".join(lines)
