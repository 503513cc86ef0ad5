"""FedAvg of a torch CNN with BatchNorm, its torch code run as JAX by `bridge_mr.from_torch`.

    python examples/fedavg_cnn_batchnorm.py            # 16 clients, 30 rounds
    python examples/fedavg_cnn_batchnorm.py --quick    # smoke run: 8 rounds

A small CNN (convolutions, BatchNorm, max pooling, dropout) learns scikit-learn's digits as
1x8x8 images, split across clients. Each FedAvg round every client starts from the server's
model, runs local SGD steps on its own batches, and the server's new model is the mean of the
clients' models: parameters *and* BatchNorm buffers (running statistics, batch counts).

The model and its loss are written once, in torch, and trained twice:

* bridge_mr: `bridge_mr.from_torch` turns the torch loss into a JAX function (BatchNorm's
  running statistics come back through `mutable=`, dropout draws from a JAX key with
  `rng=True`); a few lines of JAX run the local steps (`lax.scan` over `jax.value_and_grad`),
  and `bridge_mr.map_reduce` runs every client and averages their models, as one compiled
  program per round.
* pure torch: a loop over clients, each a deep copy of the server model trained with
  `torch.optim.SGD`, then the average of their state dicts.

Both start from the same initial model and see the same batches (dropout masks differ: torch
draws them from its own generator, bridge_mr from per-client JAX keys). Uses only public names
of bridge_mr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import bridge_mr
from bridge_mr import data as fd

LOCAL_LR = 0.1  # the clients' SGD learning rate
LOCAL_STEPS = 10
BATCH_SIZE = 32
ROUNDS, QUICK_ROUNDS = 30, 8
Tensors = dict[str, torch.Tensor]
Arrays = dict[str, jax.Array]


# The model and its loss: torch, written once.


class CNN(nn.Module):
    """Two conv-BatchNorm-ReLU-maxpool blocks (8x8 -> 4x4 -> 2x2), dropout, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 2 * 2, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 10] for images [batch, 1, 8, 8]."""
        return self.head(self.features(x))


def batch_loss(model: nn.Module, state: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of `model` in training mode with `state` on one batch.

    Args:
      model: the network, in training mode: BatchNorm normalizes with the batch's statistics
        and updates the running ones in `state` in place; dropout is on.
      state: every parameter and buffer of `model` by name (`model.state_dict()`'s keys).
      x: images [b, 1, 8, 8].
      y: class indices [b].

    Returns:
      The scalar loss.

    Example::

        loss = batch_loss(model, dict(model.state_dict()), x, y)
    """
    return F.cross_entropy(functional_call(model, state, (x,)), y)


@torch.no_grad()
def accuracy(model: nn.Module, test: Tensors) -> float:
    """The fraction of the test split `model` (in eval mode: running statistics) gets right."""
    model.eval()
    correct = model(test["x"]).argmax(dim=-1) == test["y"]
    model.train()
    return correct.float().mean().item()


# FedAvg, twice: through bridge_mr, and in a pure-torch loop over clients.


def bridge_mr_fedavg(
    model: nn.Module, *, seed: int, strategy: str
) -> Callable[[int, Tensors], Tensors]:
    """One FedAvg round of `model`'s clients through `bridge_mr.map_reduce`.

    Args:
      model: the server model (training mode); the round replaces its state.
      seed: the dropout keys' seed.
      strategy: `map_reduce`'s strategy: "auto" measures the others on the first round.

    Returns:
      `run_round(round_index, batches)`: trains every client from `model`'s state on its
      batches, sets `model`'s state to the clients' mean, and returns {"loss": mean loss}.
    """
    step_loss = bridge_mr.from_torch(
        lambda state, x, y: batch_loss(model, state, x, y), mutable=0, rng=True
    )
    names = tuple(name for name, _ in model.named_parameters())

    def client_update(server: Arrays, data: Arrays) -> dict[str, Any]:
        """One client: SGD steps from the server state; its final state and mean loss."""

        def step(state: Arrays, xs: tuple[jax.Array, ...]) -> tuple[Arrays, jax.Array]:
            x, y, i = xs
            params = {name: state[name] for name in names}

            def loss(p: Arrays) -> tuple[jax.Array, Arrays]:
                # The key of step i: dropout masks differ per client and step.
                return step_loss(jax.random.fold_in(data["key"], i), {**state, **p}, x, y)

            (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
            trained = {name: params[name] - LOCAL_LR * grads[name] for name in names}
            return {**new_state, **trained}, value

        steps = jnp.arange(data["x"].shape[0])
        final, losses = jax.lax.scan(step, server, (data["x"], data["y"], steps))
        return {"state": final, "loss": losses.mean()}

    def run_round(round_index: int, batches: Tensors) -> Tensors:
        n_clients = batches["y"].shape[0]
        keys = bridge_mr.client_keys(seed, round_index, n_clients)
        mean = bridge_mr.map_reduce(
            client_update, dict(model.state_dict()), {**batches, "key": keys}, strategy=strategy
        )
        with torch.no_grad():
            for name, value in model.state_dict().items():
                value.copy_(mean["state"][name])  # integer buffers come back as float means
        return {"loss": mean["loss"]}

    return run_round


def torch_fedavg(model: nn.Module) -> Callable[[int, Tensors], Tensors]:
    """The same round in pure torch: a deep copy of `model` per client, local SGD, the mean.

    Args:
      model: the server model (training mode); the round replaces its state.

    Returns:
      `run_round(round_index, batches)`, as `bridge_mr_fedavg`'s.
    """

    def run_round(round_index: int, batches: Tensors) -> Tensors:
        del round_index  # dropout draws from torch's generator
        states, losses = [], []
        for x, y in zip(batches["x"], batches["y"], strict=True):
            local = copy.deepcopy(model)
            optimizer = torch.optim.SGD(local.parameters(), lr=LOCAL_LR)
            for step_x, step_y in zip(x, y, strict=True):
                optimizer.zero_grad()
                loss = F.cross_entropy(local(step_x), step_y)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
            states.append(local.state_dict())
        with torch.no_grad():
            for name, value in model.state_dict().items():
                stacked = torch.stack([state[name] for state in states])
                value.copy_(stacked.double().mean(dim=0))
        return {"loss": torch.stack(losses).mean()}

    return run_round


@dataclasses.dataclass(frozen=True)
class FedAvgRun:
    """One FedAvg training: per-round losses, the test accuracy, wall times."""

    implementation: str
    losses: list[float]
    accuracy: float
    seconds: float
    first_round_seconds: float


def train(
    name: str,
    model: nn.Module,
    run_round: Callable[[int, Tensors], Tensors],
    data: tuple[fd.FederatedDataset, Tensors],
    *,
    rounds: int,
    seed: int,
) -> FedAvgRun:
    """Trains `model` in place with FedAvg: `rounds` calls of `run_round`, then the test.

    Each round every client takes `LOCAL_STEPS` batches from its own shard (passes over it,
    each in a fresh order, as many as the steps need: `cycle=True`); the batches depend only
    on `seed`, so both trainings see the same data.

    Args:
      name: the implementation's name, for the result.
      model: the server model, which `run_round` updates.
      run_round: `bridge_mr_fedavg(model, ...)` or `torch_fedavg(model)`.
      data: the clients' equal shards and the test split (`bridge_mr.data.digits`).
      rounds: how many rounds.
      seed: the batches' seed.

    Returns:
      The run's losses, test accuracy and wall times.
    """
    losses: list[float] = []
    first_round = float("nan")
    start = time.perf_counter()
    train_set, test = data
    batch_size = min(BATCH_SIZE, int(train_set.example_counts.min()))
    loop = fd.rounds(
        train_set, rounds, batch_size=batch_size, steps=LOCAL_STEPS, cycle=True, generator=seed
    )
    for round_index, rnd in enumerate(loop):  # no slot is padding: the loss needs no mask
        losses.append(run_round(round_index, rnd.batches)["loss"].item())
        if round_index == 0:
            first_round = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return FedAvgRun(name, losses, accuracy(model, test), seconds, first_round)


def positive_int(text: str) -> int:
    """An argparse type: `text` as an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --rounds, --clients, --seed, --strategy."""
    parser = argparse.ArgumentParser(
        prog="examples/fedavg_cnn_batchnorm.py",
        description="FedAvg of a torch CNN with BatchNorm on digits: bridge_mr.from_torch and "
        "bridge_mr.map_reduce beside a pure-torch loop over clients.",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_ROUNDS} rounds")
    parser.add_argument(
        "--rounds", type=positive_int, help=f"FedAvg rounds ({ROUNDS}, quick: {QUICK_ROUNDS})"
    )
    parser.add_argument("--clients", type=positive_int, default=16, help="number of clients (16)")
    parser.add_argument("--seed", type=int, default=0, help="data split, init, batches, dropout")
    parser.add_argument(
        "--strategy",
        choices=("auto", "vmap", "per_client"),
        default="auto",
        help="bridge_mr.map_reduce's strategy (auto: measured on the first round)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[FedAvgRun]:
    """Trains the CNN with FedAvg both ways; prints and returns the two runs."""
    args = parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    # Equal IID shards of the training split (the rest left out), a stratified test split.
    shards = fd.IID(args.clients, drop_remainder=True, seed=args.seed)
    data = fd.digits(shards, shape=(1, 8, 8), seed=args.seed)
    n_clients, per_client = data[0].num_clients, int(data[0].example_counts[0])
    torch.manual_seed(args.seed)
    initial = CNN()
    n_params = sum(p.numel() for p in initial.parameters())
    print(
        f"FedAvg of a CNN with BatchNorm ({n_params:,} parameters) on digits (1x8x8): "
        f"{n_clients} clients x {per_client} examples, {len(data[1]['y'])} held out; "
        f"{rounds} rounds of {LOCAL_STEPS} local SGD steps (lr={LOCAL_LR}, batch "
        f"{min(BATCH_SIZE, per_client)}); the server takes the mean of the parameters and "
        f"buffers; bridge_mr.map_reduce strategy={args.strategy}",
        flush=True,
    )
    runs = []
    for name in ("bridge_mr", "torch"):
        model = copy.deepcopy(initial)
        if name == "bridge_mr":
            run_round = bridge_mr_fedavg(model, seed=args.seed, strategy=args.strategy)
        else:
            run_round = torch_fedavg(model)
        run = train(name, model, run_round, data, rounds=rounds, seed=args.seed)
        later = (run.seconds - run.first_round_seconds) / max(rounds - 1, 1)
        print(
            f"  {name:<10} test accuracy {run.accuracy:6.1%}  loss {run.losses[0]:.4f} -> "
            f"{run.losses[-1]:.4f}  wall time {run.seconds:6.2f} s (first round "
            f"{run.first_round_seconds:.2f} s, later rounds {later * 1e3:.1f} ms each)",
            flush=True,
        )
        runs.append(run)
    return runs


if __name__ == "__main__":
    main()
