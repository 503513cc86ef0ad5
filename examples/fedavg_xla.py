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

# No JAX computation before `torch_xla.device()` below: torch-xla's runtime must own the TPU
# before JAX could start a backend of its own (importing JAX starts none).

LOCAL_LR = 0.3  # the clients' SGD learning rate
LOCAL_STEPS = 10
ROUNDS, QUICK_ROUNDS = 60, 5
Tensors = dict[str, torch.Tensor]


# The data: client shards stacked on a leading client axis, and a held-out test split.


@dataclasses.dataclass(frozen=True)
class Digits:
    """`client_x` [clients, per_client, 64] in [0, 1], `client_y` one-hot [..., 10]."""

    client_x: torch.Tensor
    client_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits(n_clients: int, seed: int) -> Digits:
    """Digits with label skew (McMahan et al., 2017): each client gets 2 label-sorted shards."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    x, y = sklearn_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y, test_size=0.2, stratify=y, random_state=seed
    )
    shard = len(y_train) // (2 * n_clients)
    rng = np.random.default_rng(seed)
    kept = rng.permutation(len(y_train))[: 2 * n_clients * shard]
    shards = kept[np.argsort(y_train[kept], kind="stable")].reshape(2 * n_clients, shard)
    index = shards[rng.permutation(2 * n_clients)].reshape(n_clients, 2 * shard)
    one_hot = np.eye(10, dtype=np.float32)[y_train]
    return Digits(
        torch.from_numpy(x_train[index]),
        torch.from_numpy(one_hot[index]),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test.astype(np.int64)),
    )


def place(data: Digits, device: torch.device, spmd: bool) -> tuple[Digits, str]:
    """`data` on `device`; under SPMD the client tensors sharded along the global mesh.

    Returns the data and how the client tensors are sharded.
    """
    on_device = Digits(*(t.to(device) for t in dataclasses.astuple(data)))
    if not spmd:
        return on_device, "one device"
    mesh = xs.get_global_mesh()
    sharded = xs.mark_sharding(on_device.client_x, mesh, ("clients", None, None))
    xs.mark_sharding(on_device.client_y, mesh, ("clients", None, None))
    return on_device, sharded.sharding_spec


def client_batches(data: Digits, *, rounds: int, batch_size: int, seed: int) -> Iterator[Tensors]:
    """Each round: `LOCAL_STEPS` batches per client from its own shard, [clients, steps, b, ...]."""
    generator = torch.Generator().manual_seed(seed)
    n_clients, per_client = data.client_x.shape[:2]
    device = data.client_x.device
    clients = torch.arange(n_clients, device=device).view(-1, 1, 1)
    for _ in range(rounds):
        keys = torch.rand(n_clients, LOCAL_STEPS, per_client, generator=generator)
        index = keys.argsort(dim=-1)[..., :batch_size].to(device)
        yield {"x": data.client_x[clients, index], "y": data.client_y[clients, index]}


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
    name: str, model: torch.nn.Module, data: Digits, rounds: Iterator[Tensors]
) -> FedAvgRun:
    """FedAvg: the clients' mean delta is the pseudo-gradient of a server SGD (lr 1) step.

    One `torch_xla.sync()` per round: without it torch-xla's lazy graph would hold every round
    so far (the parameters are never materialized) and compile anew each round.
    """
    update_fn = bridge_mr_update if name == "bridge_mr" else torch_func_update(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses: list[float] = []
    seconds: list[float] = []
    for batches in rounds:
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
        correct = model(data.test_x).argmax(dim=-1) == data.test_y
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
    data, client_sharding = place(load_digits(args.clients, args.seed), device, spmd)
    n_clients, per_client = data.client_x.shape[:2]
    batch_size = min(32, per_client)
    torch.manual_seed(args.seed)
    initial = MLP().to(device)
    torch_xla.sync()
    print(
        f"FedAvg on {device} ({n_devices} device(s), SPMD {'on' if spmd else 'off'}): "
        f"{n_clients} clients x {per_client} digits, client data sharded as "
        f"{client_sharding}; {rounds} rounds of {LOCAL_STEPS} local SGD steps "
        f"(lr={LOCAL_LR}, batch {batch_size})",
        flush=True,
    )
    names = IMPLEMENTATIONS[:1] if args.no_baseline else IMPLEMENTATIONS
    runs = []
    for name in names:
        batches = client_batches(data, rounds=rounds, batch_size=batch_size, seed=args.seed)
        run = train_fedavg(name, copy.deepcopy(initial), data, batches)
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
