"""FedAvg on a torch-xla device, with bridge_mr inside torch-xla's graph.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/fedavg_xla.py
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/fedavg_xla.py --quick
    PJRT_DEVICE=TPU python examples/fedavg_xla.py            # on a TPU VM

A torch MLP learns scikit-learn's digits, split non-IID across clients. The model, data and
optimizer are ordinary torch on the XLA device; each round's clients run `bridge_mr.map_reduce`
with a JAX client function (10 local SGD steps), which embeds one JAX program (broadcast, the
clients' steps, mean) in torch-xla's lazy graph. With SPMD (the default when there is more than
one XLA device) the clients are sharded over a ("clients",) mesh of all devices: torch-xla's
global mesh, which bridge_mr follows. `--no-baseline` skips the same FedAvg in pure torch-xla
(`torch.func.vmap` over `functional_call`). Uses only public names of bridge_mr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import bridge_mr
from bridge_mr import data as fd

# No JAX computation before `torch_xla.device()` below: torch-xla's runtime must own the TPU
# before JAX could start a backend of its own (importing JAX starts none).

LOCAL_LR = 0.3  # the clients' SGD learning rate
LOCAL_STEPS = 10
ROUNDS, QUICK_ROUNDS = 60, 5
Tensors = dict[str, torch.Tensor]


# The clients' batches under SPMD: sharded along the global mesh's "clients" axis.


def shard_clients(batch: Tensors) -> str:
    """Shards every tensor of `batch` along the global mesh's "clients" axis; returns how."""
    specs = [
        xs.mark_sharding(value, xs.get_global_mesh(), ("clients",) + (None,) * (value.ndim - 1))
        for value in batch.values()
    ]
    return specs[0].sharding_spec


# The model, in torch and as a JAX function of its parameters.


class MLP(torch.nn.Module):
    """64 -> 64 -> 10 with a ReLU: logits for the ten digits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] for images [batch, 64]."""
        return self.fc2(torch.relu(self.fc1(x)))


def jax_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """`MLP`'s mean cross-entropy in JAX, over the arrays of `dict(model.named_parameters())`."""
    hidden = jax.nn.relu(batch["x"] @ params["fc1.weight"].T + params["fc1.bias"])
    logits = hidden @ params["fc2.weight"].T + params["fc2.bias"]
    return -jnp.mean(jnp.sum(batch["y"] * jax.nn.log_softmax(logits), axis=-1))


def local_sgd(params: dict[str, jax.Array], batches: dict[str, jax.Array]) -> dict[str, Any]:
    """One client: SGD over its batches; {"delta": trained - initial, "loss": mean loss}."""

    def step(current: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(jax_loss)(current, batch)
        return jax.tree.map(lambda p, g: p - LOCAL_LR * g, current, grads), loss

    trained, losses = jax.lax.scan(step, params, batches)
    return {"delta": jax.tree.map(jnp.subtract, trained, params), "loss": losses.mean()}


# The clients' work per round: bridge_mr, or the same in pure torch-xla.


def bridge_mr_update(params: Tensors, batches: Tensors) -> dict[str, Any]:
    """The clients' mean delta and loss, through `bridge_mr.map_reduce` (mean by default)."""
    return bridge_mr.map_reduce(local_sgd, params, batches)


def torch_func_update(model: torch.nn.Module) -> Callable[[Tensors, Tensors], dict[str, Any]]:
    """The same with `torch.func.vmap` over clients of `functional_call` of `model`."""
    from torch.func import functional_call, grad_and_value, vmap

    def loss(params: Tensors, batch: Tensors) -> torch.Tensor:
        logits = functional_call(model, params, (batch["x"],))
        return -(batch["y"] * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()

    def client(params: Tensors, batches: Tensors) -> dict[str, Any]:
        current, losses = params, []
        for step in range(LOCAL_STEPS):
            grads, value = grad_and_value(loss)(current, {k: b[step] for k, b in batches.items()})
            current = {name: p - LOCAL_LR * grads[name] for name, p in current.items()}
            losses.append(value)
        delta = {name: current[name] - params[name] for name in params}
        return {"delta": delta, "loss": torch.stack(losses).mean()}

    def update(params: Tensors, batches: Tensors) -> dict[str, Any]:
        per_client = vmap(client, in_dims=(None, 0))(params, batches)
        delta = {name: d.mean(dim=0) for name, d in per_client["delta"].items()}
        return {"delta": delta, "loss": per_client["loss"].mean()}

    return update


IMPLEMENTATIONS = ("bridge_mr", "torch.func")


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


def train_fedavg(
    name: str, model: torch.nn.Module, test: Tensors, rounds: Iterator[fd.Round], spmd: bool
) -> FedAvgRun:
    """FedAvg: the clients' mean delta is the pseudo-gradient of a server SGD (lr 1) step.

    One `torch_xla.sync()` per round: without it torch-xla's lazy graph would hold every round
    so far (the parameters are never materialized) and compile anew each round. Under SPMD
    each round's batches are sharded along the global mesh's "clients" axis.
    """
    update_fn = bridge_mr_update if name == "bridge_mr" else torch_func_update(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses: list[float] = []
    seconds: list[float] = []
    for rnd in rounds:
        batches = rnd.batches  # no slot is padding: the loss needs no mask
        if spmd:
            shard_clients(batches)
        start = time.perf_counter()
        with torch.no_grad():
            update = update_fn(dict(model.named_parameters()), batches)
        for param_name, p in model.named_parameters():
            p.grad = -update["delta"][param_name]
        optimizer.step()
        torch_xla.sync()  # One round, one graph: compiled in the first round, then reused.
        losses.append(update["loss"].item())
        seconds.append(time.perf_counter() - start)
    with torch.no_grad():
        correct = model(test["x"]).argmax(dim=-1) == test["y"]
    return FedAvgRun(name, losses, seconds, correct.float().mean().item())


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
    parser.add_argument("--rounds", type=int, help=f"FedAvg rounds ({ROUNDS}, quick: 5)")
    parser.add_argument("--clients", type=int, default=16, help="number of clients (16)")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument(
        "--no-spmd", action="store_true", help="one XLA device, even when there are more"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the pure torch-xla FedAvg")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> ExampleResult:
    """Trains the MLP with FedAvg on the XLA device; prints and returns the runs."""
    args = parse_args(argv)
    n_devices = xr.global_runtime_device_count()
    spmd = not args.no_spmd and n_devices > 1
    if spmd:
        # Before any XLA tensor exists: SPMD mode is per process.
        xr.use_spmd()
        xs.set_global_mesh(xs.Mesh(np.arange(n_devices), (n_devices,), ("clients",)))
    device = torch_xla.device()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    # Label skew (McMahan et al., 2017): 2 label-sorted shards a client, on the XLA device.
    shards = fd.Shards(args.clients, drop_remainder=True, seed=args.seed)
    train, test = fd.digits(shards, seed=args.seed, device=device)
    # One-hot float labels for the loss: int64 ones would cost a range check (a sync) a round.
    one_hot = torch.nn.functional.one_hot(train.examples["y"], 10).to(torch.float32)
    train = fd.FederatedDataset({**train.examples, "y": one_hot}, train.offsets)
    n_clients, per_client = train.num_clients, int(train.example_counts[0])
    batch_size = min(32, per_client)

    def rounds_of(count: int) -> Iterator[fd.Round]:
        """`count` rounds of `LOCAL_STEPS` batches a client, from its own shard (passes over
        it, each in a fresh order, as many as the steps need); the same on every call."""
        return fd.rounds(
            train, count, batch_size=batch_size, steps=LOCAL_STEPS, cycle=True, generator=args.seed
        )

    # A first round's batches (unused), to say how the rounds' batches are sharded.
    first = next(rounds_of(1)).batches
    client_sharding = shard_clients(first) if spmd else "one device"
    torch.manual_seed(args.seed)
    initial = MLP().to(device)
    torch_xla.sync()
    print(
        f"FedAvg on {device} ({n_devices} device(s), SPMD {'on' if spmd else 'off'}): "
        f"{n_clients} clients x {per_client} digits, each round's client batches sharded as "
        f"{client_sharding}; {rounds} rounds of {LOCAL_STEPS} local SGD steps "
        f"(lr={LOCAL_LR}, batch {batch_size})",
        flush=True,
    )
    names = IMPLEMENTATIONS[:1] if args.no_baseline else IMPLEMENTATIONS
    runs = []
    for name in names:
        run = train_fedavg(name, copy.deepcopy(initial), test, rounds_of(rounds), spmd)
        print(
            f"  {name:<10}  loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}  "
            f"test accuracy {run.accuracy:6.1%}  first two rounds (compiling) "
            f"{sum(run.round_seconds[:2]):5.2f} s  later rounds "
            f"{run.steady_round_seconds * 1e3:7.1f} ms each (median)",
            flush=True,
        )
        runs.append(run)
    return ExampleResult(str(device), n_devices, spmd, client_sharding, runs)


if __name__ == "__main__":
    main()
