"""FedAvg on a torch-xla device: the federated digits demo, with bridge_mr inside torch-xla's graph.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/fedavg_xla.py
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/fedavg_xla.py --quick
    PJRT_DEVICE=TPU python examples/fedavg_xla.py            # on a TPU VM

The model, data and optimizer are ordinary torch on the XLA device; each round's clients run
`bridge_mr.map_reduce` (the demo's `BridgeClients`), which embeds one JAX program (broadcast,
10 local SGD steps per client, mean) in torch-xla's lazy graph. With SPMD (the default when
there is more than one XLA device) the clients are sharded over a ("clients",) mesh of all
devices: torch-xla's global mesh, which bridge_mr follows. `--no-baseline` skips the same
FedAvg in pure torch-xla (`torch.func.vmap` over `functional_call`, the demo's
`TorchFuncClients`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

# torch_xla before bridge_mr (which imports JAX): torch-xla's runtime must own the TPU before
# JAX could start a backend of its own.
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from bridge_mr.demo import (
    MLP,
    BridgeClients,
    Clients,
    FedAvgConfig,
    FederatedDigits,
    TorchFuncClients,
    accuracy,
    client_batches,
    load_federated_digits,
)

LOCAL_LR = 0.3  # the clients' SGD learning rate, as in `python -m bridge_mr.demo`
QUICK_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class FedAvgRun:
    """One FedAvg training run: per-round losses and wall times, final test accuracy."""

    implementation: str
    losses: list[float]
    round_seconds: list[float]
    accuracy: float

    @property
    def steady_round_seconds(self) -> float:
        """The median round time after the first two rounds (which compile); nan if none."""
        later = self.round_seconds[2:]
        return statistics.median(later) if later else float("nan")


@dataclasses.dataclass(frozen=True)
class ExampleResult:
    """What the example ran: where, how the clients were sharded, and each training run."""

    device: str
    n_devices: int
    spmd: bool
    client_sharding: str
    runs: list[FedAvgRun]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --rounds, --clients, --seed, --no-spmd, --no-baseline."""
    parser = argparse.ArgumentParser(
        prog="examples/fedavg_xla.py",
        description="FedAvg on digits on a torch-xla device, through bridge_mr.map_reduce.",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_ROUNDS} rounds")
    parser.add_argument("--rounds", type=int, help="FedAvg rounds (default: 60, quick: 5)")
    parser.add_argument("--clients", type=int, default=16, help="number of clients (16)")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument(
        "--no-spmd", action="store_true", help="one XLA device, even when there are more"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the pure torch-xla FedAvg")
    return parser.parse_args(argv)


def place_data(data: FederatedDigits, device: torch.device, spmd: bool) -> FederatedDigits:
    """`data` on `device`; under SPMD, the client tensors sharded along the global mesh."""
    on_device = data.to(device)
    if spmd:
        mesh = xs.get_global_mesh()
        xs.mark_sharding(on_device.client_x, mesh, ("clients", None, None))
        xs.mark_sharding(on_device.client_y, mesh, ("clients", None, None))
    return on_device


def train_fedavg(
    model: torch.nn.Module, data: FederatedDigits, clients: Clients, config: FedAvgConfig
) -> FedAvgRun:
    """`bridge_mr.demo.train_fedavg` with one `torch_xla.sync()` per round.

    Without the sync, torch-xla's lazy graph would hold every round so far (the parameters are
    never materialized) and compile anew each round.
    """
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.server_lr, momentum=config.server_momentum
    )
    losses: list[float] = []
    seconds: list[float] = []
    rounds = client_batches(
        data,
        rounds=config.rounds,
        batch_size=config.batch_size,
        local_steps=config.local_steps,
        seed=config.seed,
    )
    for batches in rounds:
        start = time.perf_counter()
        with torch.no_grad():
            update = clients.mean_local_update(dict(model.named_parameters()), batches)
        for name, p in model.named_parameters():
            p.grad = -update["delta"][name]
        optimizer.step()
        torch_xla.sync()  # One round, one graph: compiled in the first round, then reused.
        losses.append(update["loss"].item())
        seconds.append(time.perf_counter() - start)
    return FedAvgRun(clients.name, losses, seconds, accuracy(model, data.test_x, data.test_y))


def main(argv: Sequence[str] | None = None) -> ExampleResult:
    """Trains the demo's MLP with FedAvg on the XLA device; prints and returns the runs."""
    args = parse_args(argv)
    spmd = not args.no_spmd and xr.global_runtime_device_count() > 1
    if spmd:
        # Before any XLA tensor exists: SPMD mode is per process.
        xr.use_spmd()
        n = xr.global_runtime_device_count()
        xs.set_global_mesh(xs.Mesh(np.arange(n), (n,), ("clients",)))
    device = torch_xla.device()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else FedAvgConfig.rounds)
    data = place_data(load_federated_digits(args.clients, seed=args.seed), device, spmd)
    config = FedAvgConfig(rounds=rounds, batch_size=min(32, data.per_client), seed=args.seed)
    torch.manual_seed(args.seed)
    initial = MLP().to(device)
    torch_xla.sync()
    client_sharding = torch_xla._XLAC._get_xla_sharding_spec(data.client_x) or "one device"
    n_devices = xr.global_runtime_device_count()
    print(
        f"FedAvg on {device} ({n_devices} device(s), SPMD {'on' if spmd else 'off'}): "
        f"{data.n_clients} clients x {data.per_client} digits, client data sharded as "
        f"{client_sharding}; {rounds} rounds of {config.local_steps} local SGD steps "
        f"(lr={LOCAL_LR}, batch {config.batch_size})",
        flush=True,
    )
    implementations: list[Callable[[torch.nn.Module], Clients]] = [
        lambda model: BridgeClients(local_lr=LOCAL_LR)
    ]
    if not args.no_baseline:
        implementations.append(lambda model: TorchFuncClients(model, local_lr=LOCAL_LR))
    runs = []
    for make_clients in implementations:
        model = copy.deepcopy(initial)
        clients = make_clients(model)
        run = train_fedavg(model, data, clients, config)
        print(
            f"  {clients.name:<10}  loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}  "
            f"test accuracy {run.accuracy:6.1%}  first two rounds (compiling) "
            f"{sum(run.round_seconds[:2]):5.2f} s  later rounds "
            f"{run.steady_round_seconds * 1e3:7.1f} ms each (median)",
            flush=True,
        )
        runs.append(run)
    return ExampleResult(str(device), n_devices, spmd, client_sharding, runs)


if __name__ == "__main__":
    main()
