"""Overhead of the torch bridge against pure JAX and pure torch (interleaved A/B, medians).

    python -m benchmarks.bench_overhead [--quick]

Cases (float32, CPU):
  tiny    map_reduce FedSGD forward+backward, 4 clients, 8-wide MLP, vs
          jax.jit(jax.value_and_grad(...)) of the same jax_core program, and vs a pure-torch loop
          over the 4 clients. Targets: <= 2.5x pure JAX, <= 1.0x the torch loop.
  medium  the same with 64 clients and 256-wide layers vs pure JAX. Target: <= 1.10x.
  tf      torch_function of a tiny MLP (non-scalar output: residuals saved, VJP in backward),
          forward+backward vs the pure-JAX pair of calls (jitted forward-with-VJP, jitted VJP).
          Target: <= 2.5x.

The tiny cases also time "torch autograd floor": one custom autograd node with the same tensor
inputs and outputs whose forward and backward only allocate their results. It is what torch
alone charges for the node, so floor + pure JAX is a lower bound for any bridge; it is printed.

Each round times every contestant for a block of iterations, in turn; the reported time is the
median over rounds of the per-iteration time. XLA_FLAGS gets
--xla_cpu_experimental_ynn_fusion_type=-reduce appended where jaxlib >= 0.10 (a CPU slowdown,
jax#37465; see `benchmarks.environment.configure`), and the flags are printed.
"""

from __future__ import annotations

from .environment import configure

XLA_FLAGS = configure()  # Before JAX starts its CPU backend.

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bridge_mr import jax_core  # noqa: E402
from bridge_mr.torch_api import map_reduce, torch_function  # noqa: E402

Params = dict[str, Any]


def mlp(params: Params, x: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def client_loss(params: Params, batch: Params) -> jax.Array:
    return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)


def torch_loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] + params["b2"] - y) ** 2).mean()


def make_case(clients: int, width: int, batch: int, seed: int = 0) -> tuple[Params, Params]:
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(width, width)) / np.sqrt(width),
        "b1": np.zeros(width),
        "w2": rng.normal(size=(width, 1)) / np.sqrt(width),
        "b2": np.zeros(1),
    }
    data = {
        "x": rng.normal(size=(clients, batch, width)),
        "y": rng.normal(size=(clients, batch, 1)),
    }
    as32 = lambda tree: {k: v.astype(np.float32) for k, v in tree.items()}
    return as32(params), as32(data)


def bench(contestants: dict[str, Callable[[], Any]], rounds: int, block: int) -> dict[str, float]:
    """Median over rounds of µs per call; contestants alternate within each round."""
    for fn in contestants.values():
        for _ in range(block):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, fn in contestants.items():
            start = time.perf_counter()
            for _ in range(block):
                fn()
            samples[name].append((time.perf_counter() - start) / block * 1e6)
    return {name: statistics.median(times) for name, times in samples.items()}


class _FloorNode(torch.autograd.Function):
    """An autograd node that computes nothing: forward and backward only allocate results."""

    @staticmethod
    def forward(shapes: Any, *tensors: torch.Tensor) -> torch.Tensor:
        del tensors  # Unused.
        return torch.empty(shapes[0])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        del output  # Unused.
        ctx.shapes = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        del grad  # Unused.
        return (None, *(None if shape is None else torch.empty(shape) for shape in ctx.shapes[1:]))


def floor_contestant(
    params: dict[str, torch.Tensor],
    others: list[torch.Tensor],
    out_shape: tuple[int, ...],
    cotangent: torch.Tensor | None,
) -> Callable[[], None]:
    """torch's own cost of one bridge node over `params` (needing grads) and `others`."""
    shapes = (
        out_shape,
        *(tuple(p.shape) for p in params.values()),
        *(None for _ in others),
    )
    tensors = [*params.values(), *others]

    def floor() -> None:
        for p in params.values():
            p.grad = None
        torch.autograd.backward(_FloorNode.apply(shapes, *tensors), cotangent)

    return floor


def fedsgd_contestants(clients: int, width: int, batch: int, torch_loop: bool) -> dict[str, Any]:
    params_np, data_np = make_case(clients, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True) for k, v in params_np.items()}
    t_data = {k: torch.tensor(v) for k, v in data_np.items()}
    j_params = {k: jnp.asarray(v) for k, v in params_np.items()}
    j_data = {k: jnp.asarray(v) for k, v in data_np.items()}

    def bridge() -> None:
        for p in t_params.values():
            p.grad = None
        map_reduce(client_loss, t_params, t_data).backward()

    def program(params: Params, data: Params) -> jax.Array:
        with jax_core.program(placements={"clients": clients}):
            placed = jax_core.broadcast(params)
            return jax_core.reduce_mean(jax_core.map_fn(client_loss, (placed, data)))

    value_and_grad = jax.jit(jax.value_and_grad(program))

    def pure_jax() -> None:
        jax.block_until_ready(value_and_grad(j_params, j_data))

    contestants = {"bridge map_reduce": bridge, "pure JAX": pure_jax}
    if torch_loop:
        contestants["torch autograd floor"] = floor_contestant(
            t_params, list(t_data.values()), (), None
        )
        xs, ys = t_data["x"].unbind(0), t_data["y"].unbind(0)

        def pure_torch() -> None:
            for p in t_params.values():
                p.grad = None
            total = torch_loss(t_params, xs[0], ys[0])
            for x, y in zip(xs[1:], ys[1:], strict=True):
                total = total + torch_loss(t_params, x, y)
            (total / clients).backward()

        contestants["pure torch loop"] = pure_torch
    return contestants


def torch_function_contestants(width: int, batch: int) -> dict[str, Any]:
    params_np, data_np = make_case(1, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True) for k, v in params_np.items()}
    t_x = torch.tensor(data_np["x"][0])
    j_params = {k: jnp.asarray(v) for k, v in params_np.items()}
    j_x = jnp.asarray(data_np["x"][0])
    f = torch_function(mlp)
    t_ct = torch.ones(batch, 1)
    j_ct = jnp.ones((batch, 1), jnp.float32)

    def bridge() -> None:
        for p in t_params.values():
            p.grad = None
        torch.autograd.backward(f(t_params, t_x), t_ct)

    @jax.jit
    def forward(params: Params, x: jax.Array) -> tuple[jax.Array, Any]:
        out, vjp = jax.vjp(lambda p: mlp(p, x), params)
        return out, vjp

    @jax.jit
    def backward(vjp: Any, ct: jax.Array) -> Any:
        return vjp(ct)

    def pure_jax() -> None:
        _, vjp = forward(j_params, j_x)
        jax.block_until_ready(backward(vjp, j_ct))

    return {
        "bridge torch_function": bridge,
        "pure JAX pair": pure_jax,
        "torch autograd floor": floor_contestant(t_params, [t_x], (batch, 1), t_ct),
    }


def report(title: str, times: dict[str, float], base: str, targets: dict[str, float]) -> None:
    print(f"\n{title}")
    jax_name = next(name for name in times if name.startswith("pure JAX"))
    for name, us in times.items():
        line = f"  {name:24s} {us:10.1f} µs"
        if name != base:
            ratio = times[base] / us
            line += f"   bridge / this = {ratio:5.2f}x"
            if name in targets:
                verdict = "met" if ratio <= targets[name] else "MISSED"
                line += f"  (target <= {targets[name]:.2f}x: {verdict})"
        print(line)
    if "torch autograd floor" in times:
        bound = times["torch autograd floor"] + times[jax_name]
        own = times[base] - bound
        print(
            f"  lower bound, floor + {jax_name}: {bound:.1f} µs = {bound / times[jax_name]:.2f}x "
            f"{jax_name}; the bridge's own cost above it: {own:.1f} µs"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument(
        "--sync-dispatch",
        action="store_true",
        help="run JAX CPU computations on the calling thread (jax_cpu_enable_async_dispatch="
        "False) for every contestant: no thread handoff per call",
    )
    args = parser.parse_args()
    if args.sync_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # Before the backend starts.
    rounds, block = (5, 50) if args.quick else (30, 200)
    medium_rounds, medium_block = (3, 3) if args.quick else (15, 10)

    print(f"XLA_FLAGS={XLA_FLAGS}")
    print(f"jax_cpu_enable_async_dispatch={jax.config.read('jax_cpu_enable_async_dispatch')}")
    print(
        f"torch {torch.__version__}, jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )

    tiny = bench(fedsgd_contestants(4, 8, 16, torch_loop=True), rounds, block)
    report(
        "tiny FedSGD fwd+bwd (4 clients, 8-wide MLP, batch 16)",
        tiny,
        "bridge map_reduce",
        {"pure JAX": 2.5, "pure torch loop": 1.0},
    )
    medium = bench(fedsgd_contestants(64, 256, 32, torch_loop=False), medium_rounds, medium_block)
    report(
        "medium FedSGD fwd+bwd (64 clients, 256-wide MLP, batch 32)",
        medium,
        "bridge map_reduce",
        {"pure JAX": 1.10},
    )
    tf = bench(torch_function_contestants(8, 16), rounds, block)
    report(
        "torch_function tiny MLP fwd+bwd (8-wide, batch 16, residuals)",
        tf,
        "bridge torch_function",
        {"pure JAX pair": 2.5},
    )


if __name__ == "__main__":
    main()
