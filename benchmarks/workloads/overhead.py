"""Per-call overhead contestants (the "overhead" case): the bridge against pure JAX and torch.

The model is a one-hidden-layer tanh MLP with one output and a squared-error loss, small enough
that the bridge's own cost per call shows; torch's floor for one autograd node (it computes
nothing) bounds any bridge from below together with pure JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def overhead_mlp(params: Mapping[str, Any], x: Any) -> Any:
    """The overhead case's MLP in JAX: tanh hidden layer, one output."""
    import jax.numpy as jnp

    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def overhead_loss(params: Mapping[str, Any], batch: Mapping[str, Any]) -> Any:
    """Mean squared error of `overhead_mlp` on one client's {"x", "y"}."""
    import jax.numpy as jnp

    return jnp.mean((overhead_mlp(params, batch["x"]) - batch["y"]) ** 2)


def _overhead_torch_mlp(params: Mapping[str, Any], x: Any) -> Any:
    import torch

    return torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def overhead_data(
    clients: int, width: int, batch: int, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """float32 MLP parameters and client data {"x": [clients, batch, width], "y": [..., 1]}."""
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


def _floor_node(device: str | None) -> Any:
    """An autograd node that computes nothing: forward and backward only allocate results (on
    `device`; None: torch's default)."""
    import torch

    class FloorNode(torch.autograd.Function):
        @staticmethod
        def forward(shapes: Any, *tensors: torch.Tensor) -> torch.Tensor:
            del tensors  # Unused.
            return torch.empty(shapes[0], device=device)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            del output  # Unused.
            ctx.shapes = inputs[0]

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            del grad  # Unused.
            return (
                None,
                *(None if s is None else torch.empty(s, device=device) for s in ctx.shapes[1:]),
            )

    return FloorNode


def polled(call: Callable[[], Any], seconds: float = 100e-6) -> Callable[[], None]:
    """`call` (a jitted call), waited for as the bridge waits: polling its first output's
    `is_ready` for up to `seconds` (all outputs of one execution complete together), then
    blocking. A pure-JAX user's `jax.block_until_ready` on the whole result costs more on a
    CPU, so a lower bound for a bridge waits this way."""
    import time

    import jax

    def waited() -> None:
        first = jax.tree_util.tree_leaves(call())[0]
        deadline = time.perf_counter() + seconds
        while not first.is_ready():
            if time.perf_counter() > deadline:
                first.block_until_ready()
                return

    return waited


def autograd_floor(
    params: Mapping[str, Any],
    others: list[Any],
    out_shape: tuple[int, ...],
    cotangent: Any,
    inside: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """torch's own cost of one bridge node over `params` (needing grads) and `others`.

    One custom autograd node with those tensor inputs and an output of `out_shape`, whose
    forward and backward only allocate their results. With `inside` (the pure-JAX call,
    `polled`), that call runs between the node's forward and its backward: the work of both in
    one call, torch's and JAX's code sharing the caches as they do in any bridge's call, which
    the sum of the two measured apart leaves out.
    """
    import torch

    device = next(iter(params.values())).device
    node = _floor_node(None if device.type == "cpu" else str(device))
    shapes = (out_shape, *(tuple(p.shape) for p in params.values()), *(None for _ in others))
    tensors = [*params.values(), *others]

    def floor() -> None:
        for p in params.values():
            p.grad = None
        output = node.apply(shapes, *tensors)
        if inside is not None:
            inside()
        torch.autograd.backward(output, cotangent)

    return synced(floor, device.type)


def synced(contestant: Callable[[], None], device_type: str) -> Callable[[], None]:
    """`contestant`, then a wait for the CUDA work it queued (on the CPU: `contestant` itself):
    each contestant returns once its results are computed."""
    if device_type != "cuda":
        return contestant
    import torch

    def waited() -> None:
        contestant()
        torch.cuda.synchronize()

    return waited


def _placed(tree: Mapping[str, Any], device_type: str) -> dict[str, Any]:
    """numpy arrays as JAX arrays on JAX's first device of `device_type` ("cpu": the default)."""
    import jax
    import jax.numpy as jnp

    if device_type == "cpu":
        return {k: jnp.asarray(v) for k, v in tree.items()}
    target = jax.devices(device_type)[0]
    return {k: jax.device_put(v, target) for k, v in tree.items()}


def map_reduce_contestants(
    clients: int, width: int, batch: int, device: str = "cpu"
) -> dict[str, Callable[[], Any]]:
    """FedSGD forward+backward (mean client loss, gradients) five ways, no optimizer step, with
    the tensors and arrays on `device` ("cpu" or "cuda").

    The contestants return None: each waits for its own results, and the per-call cost of
    syncing returned trees would add to what these rows measure.

    "bridge map_reduce": `bridge_mr.map_reduce` from torch, gradients left in `.grad`;
    "pure JAX": `jax.jit(jax.value_and_grad(...))` of the same `bridge_mr.jax_core` program;
    "torch autograd floor": `autograd_floor` with the bridge's inputs and output;
    "floor + pure JAX in one call": that floor with the pure JAX call inside (`polled`);
    "pure torch loop": the same MLP in torch, a Python loop over the clients.
    """
    import jax
    import torch

    import bridge_mr
    from bridge_mr import jax_core

    params_np, data_np = overhead_data(clients, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True, device=device) for k, v in params_np.items()}
    t_data = {k: torch.tensor(v, device=device) for k, v in data_np.items()}
    j_params, j_data = _placed(params_np, device), _placed(data_np, device)

    def bridge() -> None:
        for p in t_params.values():
            p.grad = None
        bridge_mr.map_reduce(overhead_loss, t_params, t_data).backward()

    def program(params: Mapping[str, Any], data: Mapping[str, Any]) -> Any:
        with jax_core.program(placements={"clients": clients}):
            placed = jax_core.broadcast(params)
            return jax_core.reduce_mean(jax_core.map_fn(overhead_loss, (placed, data)))

    value_and_grad = jax.jit(jax.value_and_grad(program))

    def pure_jax_call() -> Any:
        return value_and_grad(j_params, j_data)

    def pure_jax() -> None:
        jax.block_until_ready(pure_jax_call())

    xs, ys = t_data["x"].unbind(0), t_data["y"].unbind(0)

    def client_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((_overhead_torch_mlp(t_params, x) - y) ** 2).mean()

    def pure_torch() -> None:
        for p in t_params.values():
            p.grad = None
        total = client_loss(xs[0], ys[0])
        for x, y in zip(xs[1:], ys[1:], strict=True):
            total = total + client_loss(x, y)
        (total / clients).backward()

    return {
        "bridge map_reduce": synced(bridge, device),
        "pure JAX": pure_jax,
        "torch autograd floor": autograd_floor(t_params, list(t_data.values()), (), None),
        "floor + pure JAX in one call": autograd_floor(
            t_params, list(t_data.values()), (), None, polled(pure_jax_call)
        ),
        "pure torch loop": synced(pure_torch, device),
    }


def torch_function_contestants(
    width: int, batch: int, device: str = "cpu"
) -> dict[str, Callable[[], Any]]:
    """The MLP's forward+backward with a [batch, 1] output (residuals saved), five ways, on
    `device` ("cpu" or "cuda").

    The contestants return None, as `map_reduce_contestants`' do.

    "bridge torch_function": `bridge_mr.torch_function(overhead_mlp)`, VJP in backward;
    "pure JAX pair": the jitted forward-with-VJP, then the jitted VJP;
    "torch autograd floor": `autograd_floor` with the bridge's inputs and output;
    "floor + pure JAX in one call": that floor with the pure JAX pair inside (`polled`);
    "pure torch": the same MLP in torch.
    """
    import jax
    import torch

    import bridge_mr

    params_np, data_np = overhead_data(1, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True, device=device) for k, v in params_np.items()}
    t_x = torch.tensor(data_np["x"][0], device=device)
    j_params = _placed(params_np, device)
    j_x, j_ct = _placed(
        {"x": data_np["x"][0], "ct": np.ones((batch, 1), np.float32)}, device
    ).values()
    f = bridge_mr.torch_function(overhead_mlp)
    t_ct = torch.ones(batch, 1, device=device)

    def bridge() -> None:
        for p in t_params.values():
            p.grad = None
        torch.autograd.backward(f(t_params, t_x), t_ct)

    @jax.jit
    def forward(params: Mapping[str, Any], x: Any) -> tuple[Any, Any]:
        return jax.vjp(lambda p: overhead_mlp(p, x), params)

    @jax.jit
    def backward(vjp: Any, ct: Any) -> Any:
        return vjp(ct)

    def pure_jax_pair() -> Any:
        _, vjp = forward(j_params, j_x)
        return backward(vjp, j_ct)

    def pure_jax() -> None:
        jax.block_until_ready(pure_jax_pair())

    def pure_torch() -> None:
        for p in t_params.values():
            p.grad = None
        _overhead_torch_mlp(t_params, t_x).backward(t_ct)

    return {
        "bridge torch_function": synced(bridge, device),
        "pure JAX pair": pure_jax,
        "torch autograd floor": autograd_floor(t_params, [t_x], (batch, 1), t_ct),
        "floor + pure JAX in one call": autograd_floor(
            t_params, [t_x], (batch, 1), t_ct, polled(pure_jax_pair)
        ),
        "pure torch": synced(pure_torch, device),
    }
