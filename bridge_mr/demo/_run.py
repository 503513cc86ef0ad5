"""The demo run: FedSGD and FedAvg by bridge_mr and by the torch baselines, side by side."""

from __future__ import annotations

import copy
import dataclasses
import functools
import platform
import time
from collections.abc import Callable, Iterator

import jax
import torch

from bridge_mr import data as fd

from ._baseline import TorchFuncClients, TorchLoopClients
from ._clients import BridgeClients
from ._model import MLP, N_CLASSES
from ._report import (
    Comparison,
    comparisons,
    duration,
    format_load,
    format_speed,
    format_table,
)
from ._train import (
    Clients,
    FedAvgConfig,
    FedSGDConfig,
    PhaseResult,
    Run,
    Tensors,
    fedavg_step,
    fedsgd_step,
    train,
)

LOCAL_LR = 0.3


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What to run: clients, rounds per algorithm, the seed, the baselines, torch's threads."""

    clients: int = 64
    rounds: int = 60
    seed: int = 0
    baseline: bool = True
    # One torch thread by default: with two on a 2-core machine that other processes kept busy,
    # the torch baselines' rounds took 10-25x as long as with one (docs/demo.md).
    torch_threads: int = 1


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

    def comparisons(self) -> list[Comparison]:
        """bridge_mr against each baseline, per algorithm, as the report prints them."""
        return comparisons(self.phases)

    def table(self) -> str:
        """The runs side by side: accuracy, final loss, first round, later rounds, all rounds."""
        return format_table(self.phases)

    def speed_summary(self) -> str:
        """bridge_mr against each baseline, then where it was slower ("" with no baseline)."""
        return format_speed(self.phases)


def run_demo(
    config: DemoConfig, *, show_progress: bool = True, echo: Callable[[str], None] = print
) -> DemoResult:
    """Trains the same initial MLP with FedSGD and FedAvg, by bridge_mr and the baselines.

    The implementations' rounds are interleaved on the same batches (`train`). Prints (through
    `echo`) what runs, one line per training run, a table (first round apart from the median
    later round), bridge_mr against each baseline with where it was slower, and how busy the
    rest of the machine was; every number in it comes from this run.

    Args:
      config: clients, rounds per algorithm, seed, and whether to run the torch baselines.
      show_progress: a progress bar per algorithm (on stderr, when it is a terminal).
      echo: where the printed lines go.

    Returns:
      Every training run (FedSGD, then FedAvg; bridge_mr, then the baselines) and the time.

    Raises:
      ValueError: `config.rounds` is below 2 (a first round and a later one),
        `config.torch_threads` below 1, or `config.clients` not between 1 and 718 (two
        non-empty shards each: `bridge_mr.data.Shards` says so).
    """
    if config.rounds < 2:
        raise ValueError(
            "rounds must be at least 2 (the first round, which includes bridge_mr's "
            f"compilation, and later rounds to compare); got {config.rounds}."
        )
    if config.torch_threads < 1:
        raise ValueError(
            f"torch_threads must be at least 1 (torch's intra-op threads); got "
            f"{config.torch_threads}. Pass torch_threads=1, or the number of cores."
        )
    start = time.perf_counter()
    # Label skew (McMahan et al., 2017): each client 2 of 2 x clients equal label-sorted shards
    # of the training split (examples that fill no whole shard left out); 20% held out.
    shards = fd.Shards(config.clients, drop_remainder=True, seed=config.seed)
    data = fd.digits(shards, seed=config.seed)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)
    try:
        phases = _train_all(config, data, default_threads, show_progress, echo)
    finally:
        torch.set_num_threads(default_threads)
    result = DemoResult(phases=phases, seconds=time.perf_counter() - start)
    echo("")
    echo(result.table())
    echo(
        "1st round: bridge_mr traces the torch loss into JAX, compiles the round with XLA and "
        'picks strategy="auto"\'s strategy; the torch baselines compile nothing (their first '
        "round is PyTorch's own warm-up)."
    )
    if config.baseline:
        echo(
            "same init, same batches: largest per-round FedSGD loss difference from bridge_mr: "
            + ", ".join(
                f"{name} {loss_gap(result, 'FedSGD', name):.1e}"
                for name in (TorchFuncClients.name, TorchLoopClients.name)
            )
        )
        echo("")
        echo(result.speed_summary())
    echo(format_load(phases))
    return result


def _train_all(
    config: DemoConfig,
    data: tuple[fd.FederatedDataset, Tensors],
    default_threads: int,
    show_progress: bool,
    echo: Callable[[str], None],
) -> list[PhaseResult]:
    """Describes the runs, then trains FedSGD, then FedAvg, every implementation side by side."""
    torch.manual_seed(config.seed)
    initial = MLP()
    train_set, test = data
    batch_size = min(32, int(train_set.example_counts.min()))
    fedsgd = FedSGDConfig(rounds=config.rounds, batch_size=batch_size, seed=config.seed)
    fedavg = FedAvgConfig(rounds=config.rounds, batch_size=batch_size, seed=config.seed)
    _describe(config, data, initial, fedsgd, fedavg, default_threads, echo)

    implementations: list[Callable[[torch.nn.Module], Clients]] = [
        lambda model: BridgeClients(model, local_lr=LOCAL_LR)
    ]
    if config.baseline:
        implementations.append(lambda model: TorchFuncClients(model, local_lr=LOCAL_LR))
        implementations.append(lambda model: TorchLoopClients(model, local_lr=LOCAL_LR))
    phases: list[PhaseResult] = []
    for algorithm, step, local_steps in (
        ("FedSGD", functools.partial(fedsgd_step, config=fedsgd), None),
        ("FedAvg", functools.partial(fedavg_step, config=fedavg), fedavg.local_steps),
    ):
        runs = []
        for make_clients in implementations:
            model = copy.deepcopy(initial)
            clients = make_clients(model)
            runs.append(Run(model, clients.name, step(model, clients)))
        batches = _batches(train_set, config, batch_size, local_steps)
        results = train(
            algorithm, runs, batches, test, rounds=config.rounds, show_progress=show_progress
        )
        for r in results:
            echo(
                f"  {r.algorithm} {r.implementation:<10}  test accuracy {r.accuracy:6.1%}  "
                f"final loss {r.losses[-1]:.4f}  first round {duration(r.first_round_seconds)}, "
                f"later rounds {duration(r.later_round_seconds)} (median)"
            )
        phases += results
    return phases


def _batches(
    train_set: fd.FederatedDataset, config: DemoConfig, batch_size: int, local_steps: int | None
) -> Iterator[Tensors]:
    """Each round's {"x", "y"} for every client: [clients, batch_size, ...] (FedSGD), or
    [clients, local_steps, batch_size, ...] (FedAvg: passes over each client's data, each in a
    fresh order, as many as the steps need). The seed's: every implementation sees the same."""
    loop = fd.rounds(
        train_set,
        config.rounds,
        batch_size=batch_size,
        steps=local_steps or 1,
        cycle=True,
        generator=config.seed,
    )
    for rnd in loop:  # no slot is padding: the mask is left out
        batch = {name: rnd.batches[name] for name in ("x", "y")}
        yield batch if local_steps else {name: value.squeeze(1) for name, value in batch.items()}


def _describe(
    config: DemoConfig,
    data: tuple[fd.FederatedDataset, Tensors],
    model: torch.nn.Module,
    fedsgd: FedSGDConfig,
    fedavg: FedAvgConfig,
    default_threads: int,
    echo: Callable[[str], None],
) -> None:
    """Prints the data, the model, the two algorithms and the implementations."""
    n_params = sum(p.numel() for p in model.parameters())
    train_set, test = data
    n_clients = train_set.num_clients
    owner = torch.repeat_interleave(torch.arange(n_clients), train_set.example_counts)
    pairs = torch.unique(owner * N_CLASSES + train_set.examples["y"])  # (client, digit) held
    digits = torch.bincount(pairs // N_CLASSES, minlength=n_clients)
    fewest, most = int(digits.min()), int(digits.max())
    echo(
        f"data: scikit-learn digits, {n_clients} clients x {int(train_set.example_counts[0])} "
        f"examples (label-skewed: 2 label-sorted shards each, so each client holds "
        f"{fewest if fewest == most else f'{fewest} to {most}'} of the 10 digits), "
        f"{len(test['y'])} held-out test examples"
    )
    echo(
        f"model: MLP 64-64-10 ({n_params:,} parameters), written once in torch; "
        f"torch {torch.__version__}, jax {jax.__version__}, {jax.devices()[0].platform} "
        f"({platform.machine()}), {torch.get_num_threads()} torch thread(s) (this process's "
        f"before the demo: {default_threads}; --torch-threads)"
    )
    echo(
        f"FedSGD: {fedsgd.rounds} rounds; each client's loss on {fedsgd.batch_size} examples, "
        f"mean over clients, loss.backward(), Adam(lr={fedsgd.lr}) on the server"
    )
    echo(
        f"FedAvg: {fedavg.rounds} rounds; each client runs {fedavg.local_steps} SGD steps "
        f"(lr={LOCAL_LR}, batch {fedavg.batch_size}), the mean delta is the server's "
        f"pseudo-gradient for SGD(lr={fedavg.server_lr})"
    )
    echo(
        "bridge_mr: map_reduce of the torch loss converted by bridge_mr.from_torch "
        '(strategy="auto"), one XLA program per round'
    )
    if config.baseline:
        echo("torch.func: the same torch loss, torch.func.vmap over all clients at once")
        echo(
            "torch loop: the loop a torch user writes, one client after another: nn.Module "
            "forward, loss.backward(), torch.optim.SGD for FedAvg's local steps"
        )
        echo("(the three run the same init on the same batches, their rounds interleaved)")


def loss_gap(result: DemoResult, algorithm: str, implementation: str) -> float:
    """The largest per-round loss difference of `algorithm` between bridge_mr and another."""
    ours = result.phase(algorithm, BridgeClients.name).losses
    theirs = result.phase(algorithm, implementation).losses
    return max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
