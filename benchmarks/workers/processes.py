"""The torchrun worker of the "processes" case: times FedSGD / FedAvg rounds over every rank's
clients, and (with several processes) one all-reduce of the payload and one agreement.

    python -m torch.distributed.run --nproc-per-node=K -m benchmarks.workers.processes \
        OUT.json CLIENTS REPS HIDDEN[,HIDDEN...]

(from the repository root: the rounds are timed by `benchmarks.harness`).

For each hidden width (the payload: an MLP of 64 -> HIDDEN -> 10) and each round (FedSGD, then
FedAvg), rank 0 writes {"<round>/<hidden>": {"round": [seconds per round], "all_reduce": [...],
"agree": [...]}} to OUT.json.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
import bridge_mr  # noqa: E402

PROCESS = bridge_mr.distributed.initialize(heartbeat_timeout_seconds=30)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from .. import harness  # noqa: E402

FEATURES, CLASSES, BATCH, LOCAL_STEPS = 64, 10, 32, 2


def client_loss(p: dict, c: dict) -> jax.Array:
    h = jnp.tanh(c["x"] @ p["w1"] + p["b1"])
    logp = jax.nn.log_softmax(h @ p["w2"] + p["b2"])
    return -jnp.mean(jnp.take_along_axis(logp, c["y"][:, None], axis=1))


def local_sgd(p: dict, c: dict) -> dict:
    new = p
    for _ in range(LOCAL_STEPS):
        grads = jax.grad(client_loss)(new, c)
        new = jax.tree.map(lambda w, g: w - 0.1 * g, new, grads)
    return jax.tree.map(jnp.subtract, new, p)


def measure(kind: str, hidden: int, clients: int, reps: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    params = {
        "w1": (torch.randn(FEATURES, hidden) * 0.1).requires_grad_(),
        "b1": torch.zeros(hidden, requires_grad=True),
        "w2": (torch.randn(hidden, CLASSES) * 0.1).requires_grad_(),
        "b2": torch.zeros(CLASSES, requires_grad=True),
    }
    opt = torch.optim.SGD(params.values(), lr=0.1)
    per = clients // PROCESS.world_size
    g = torch.Generator().manual_seed(1 + PROCESS.rank)
    data = {
        "x": torch.randn(per, BATCH, FEATURES, generator=g),
        "y": torch.randint(0, CLASSES, (per, BATCH), generator=g, dtype=torch.int32),
    }

    def fedsgd() -> None:
        opt.zero_grad()
        bridge_mr.map_reduce(client_loss, params, data, strategy="vmap").backward()
        opt.step()

    def fedavg() -> None:
        delta = bridge_mr.map_reduce(
            local_sgd, {k: v.detach() for k, v in params.items()}, data, strategy="vmap"
        )
        opt.zero_grad()
        for k, v in params.items():
            v.grad = -delta[k]
        opt.step()

    round_ = fedsgd if kind == "fedsgd" else fedavg
    for _ in range(2):
        round_()  # Compiles.
    timings: dict[str, list[float]] = {
        "round": harness.time_calls(round_, reps),
        "all_reduce": [],
        "agree": [],
    }
    if PROCESS.world_size > 1:
        size = sum(v.numel() for v in params.values())
        # One CPU device per process, as map_reduce's cross-process program uses.
        first = {d.process_index: d for d in sorted(jax.devices(), key=lambda d: -d.id)}
        devices = np.array([first[p] for p in sorted(first)])
        mesh = jax.sharding.Mesh(devices, ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        local = np.ones((1, size), np.float32)
        stacked = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
        total = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
        total(stacked).block_until_ready()
        timings["all_reduce"] = harness.time_calls(lambda: total(stacked), reps)
        timings["agree"] = harness.time_calls(
            lambda: bridge_mr.distributed.agree(per, "benchmark", None, (), where="benchmark"),
            reps,
        )
    return timings


def main(out: str, clients: int, reps: int, hiddens: list[int]) -> None:
    results = {
        f"{kind}/{hidden}": measure(kind, hidden, clients, reps)
        for hidden in hiddens
        for kind in ("fedsgd", "fedavg")
    }
    if PROCESS.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    out, clients, reps, hiddens = sys.argv[1:5]
    main(out, int(clients), int(reps), [int(h) for h in hiddens.split(",")])
