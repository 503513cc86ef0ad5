"""A FedAvg round of any model, each way the benchmarks run one, given its model, loss and data.

Every family (`federated`'s MLPs, `rounds`' CNN and LM, the "from_torch" case) builds its FedAvg
alternatives from these, so that an alternative computes the same round in every case: each
client starts from the server parameters and takes one SGD step per batch of its data
([clients, local_steps, ...] per array); the server adds the mean of the clients' deltas.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

#: (params, batch) -> the loss of one batch.
Loss = Callable[[Any, Any], Any]


def local_sgd(loss: Loss, lr: float, *, unroll: int | bool = 1) -> Callable[[Any, Any], Any]:
    """The JAX client function (params, data) -> delta: one SGD step of `loss` per batch.

    The steps run under `lax.scan` over `data`'s leading axis, unrolled as `unroll` says.
    """
    import jax

    def update(params: Any, data: Any) -> Any:
        def step(p: Any, batch: Any) -> tuple[Any, None]:
            grads = jax.grad(loss)(p, batch)
            return jax.tree.map(lambda a, g: a - lr * g, p, grads), None

        final, _ = jax.lax.scan(step, params, data, unroll=unroll)
        return jax.tree.map(lambda a, b: a - b, final, params)

    return update


def jax_round(step: Callable[[Any, Any], Any], params: Any, data: Any) -> Callable[[], Any]:
    """A round that replaces the JAX state (from `params`) by `step(state, data)` each call."""
    state = [params]

    def jax_state_round() -> Any:
        state[0] = step(state[0], data)
        return state[0]

    return jax_state_round


def drjax_fedavg(
    update: Callable[[Any, Any], Any], clients: int, params: Any, data: Any
) -> Callable[[], Any]:
    """The round written with `drjax` in pure JAX, one jitted function of the state.

    `update` is the JAX client function (`local_sgd`'s), `data` the clients' stacked data.
    """
    import drjax
    import jax

    @drjax.program(placements={"clients": clients})
    def mean_delta(p: Any, client_data: Any) -> Any:
        return drjax.reduce_mean(drjax.map_fn(update, (drjax.broadcast(p), client_data)))

    jitted = jax.jit(lambda p, d: jax.tree.map(lambda a, b: a + b, p, mean_delta(p, d)))
    return jax_round(jitted, params, data)


def bridge_mr_fedavg(
    update: Callable[[Any, Any], Any],
    params: Mapping[str, Any],
    data: Any,
    *,
    no_grad: bool = True,
    **options: Any,
) -> Callable[[], Any]:
    """The round from torch: `bridge_mr.map_reduce` of the JAX client function `update`, its
    mean delta added to `params` in place; `options` go to map_reduce.

    `no_grad`: the round runs under `torch.no_grad()`; else under the caller's grad mode (then
    `params` must be detached tensors).
    """
    import torch

    from bridge_mr import map_reduce

    def bridge_mr_round() -> Any:
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            delta = map_reduce(update, params, data, reduce="mean", **options)
            for name, p in params.items():
                p.add_(delta[name])
        return list(params.values())

    return bridge_mr_round


def torch_vmap_fedavg(
    server: dict[str, Any], data: tuple[Any, ...], loss: Loss, *, local_steps: int, lr: float
) -> Callable[[], Any]:
    """The round with `torch.func.vmap` over clients of the local steps, each `torch.func.grad`
    of `loss(params, batch)` (a pure function of the parameters: `functional_call`).

    `server` (detached tensors) is updated in place; `data` is a tuple of [clients,
    local_steps, ...] tensors, `batch` the tuple of one step's slices.
    """
    import torch
    from torch.func import grad, vmap

    loss_grad = grad(loss)

    def client_update(p: dict[str, Any], client: tuple[Any, ...]) -> dict[str, Any]:
        local = p
        for k in range(local_steps):
            g = loss_grad(local, tuple(a[k] for a in client))
            local = {name: local[name] - lr * g[name] for name in local}
        return {name: local[name] - p[name] for name in p}

    client_deltas = vmap(client_update, in_dims=(None, 0))

    def torch_vmap_round() -> Any:
        deltas = client_deltas(server, data)
        with torch.no_grad():
            for name, p in server.items():
                p.add_(deltas[name].mean(dim=0))
        return list(server.values())

    return torch_vmap_round


def torch_fedavg_loop(
    model: Any,
    clients: int,
    local_steps: int,
    lr: float,
    step_loss: Callable[[Any, int, int], Any],
) -> Callable[[], Any]:
    """A FedAvg round as a Python loop over clients, updating `model`'s parameters in place.

    Per client: the server weights copied into a local copy of `model`, `local_steps` steps of
    `torch.optim.SGD` on `step_loss(local_model, client, step)`, the delta added to a sum; then
    the server adds the mean delta. Returns the round (a function returning the parameters).
    """
    import torch

    server = list(model.parameters())
    local = copy.deepcopy(model)
    local_params = list(local.parameters())
    optimizer = torch.optim.SGD(local_params, lr=lr)
    delta_sum = [torch.zeros_like(p) for p in server]

    def fedavg_round() -> Any:
        with torch.no_grad():
            for d in delta_sum:
                d.zero_()
        for c in range(clients):
            with torch.no_grad():
                for lp, p in zip(local_params, server, strict=True):
                    lp.copy_(p)
            for k in range(local_steps):
                optimizer.zero_grad()
                step_loss(local, c, k).backward()
                optimizer.step()
            with torch.no_grad():
                for d, lp, p in zip(delta_sum, local_params, server, strict=True):
                    d.add_(lp).sub_(p)
        with torch.no_grad():
            for p, d in zip(server, delta_sum, strict=True):
                p.add_(d, alpha=1.0 / clients)
        return server

    return fedavg_round
