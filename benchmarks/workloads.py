"""Federated workloads: MLP models, synthetic client data, and one training round per alternative.

A round is the same computation in every alternative, started from the same parameters and
data:

* FedSGD: the mean over clients of each client's loss on its batch, its gradient with respect
  to the server parameters, one SGD step on the server.
* FedAvg: each client starts from the server parameters and runs `local_steps` SGD steps on its
  own batches; the server adds the mean of the clients' parameter deltas.

Alternatives:

* `torch_loop`: a pure-torch Python loop over clients (`nn.Module`, `torch.optim.SGD`).
* `torch_vmap`: `torch.func.vmap` over clients of `functional_call` (FedAvg: vmapped steps of
  `torch.func.grad`).
* `drjax`: the round written with the `drjax` package in pure JAX, one `jax.jit`.
* `bridge_mr`: a torch loop calling `bridge_mr.map_reduce` with a JAX client function (the same
  one `drjax` maps); FedSGD steps a `torch.optim.SGD` after `loss.backward()`.
* `torch_xla`, `bridge_mr_xla`: `torch_vmap` and `bridge_mr` on a torch-xla device; only in an
  environment with torch_xla.

The models take torch's `nn.Linear` layout (`weight` is [out, in]) on both sides, so
`dict(model.named_parameters())` is the JAX functions' parameter tree.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: Layer widths (input, hidden..., classes) of the models.
MODELS: dict[str, tuple[int, ...]] = {
    "small": (64, 128, 10),
    "medium": (64, 1024, 1024, 10),
}

ALTERNATIVES = ("bridge_mr", "drjax", "torch_vmap", "torch_loop")
XLA_ALTERNATIVES = ("bridge_mr_xla", "torch_xla")


@dataclasses.dataclass(frozen=True)
class FedConfig:
    """One federated round.

    Attributes:
      algo: "fedsgd" or "fedavg".
      model: a key of `MODELS`.
      clients: number of clients in the round.
      batch: examples per client per step.
      local_steps: SGD steps per client (FedAvg; FedSGD uses one batch per client).
      lr: learning rate of the SGD steps.
    """

    algo: str
    model: str
    clients: int
    batch: int = 32
    local_steps: int = 10
    lr: float = 0.05

    @property
    def widths(self) -> tuple[int, ...]:
        """Layer widths of the model."""
        return MODELS[self.model]

    @property
    def steps(self) -> int:
        """SGD steps each client takes in one round."""
        return self.local_steps if self.algo == "fedavg" else 1


def n_params(widths: tuple[int, ...]) -> int:
    """Number of parameters of the MLP with these layer widths."""
    return sum(i * o + o for i, o in itertools.pairwise(widths))


def train_flops(cfg: FedConfig) -> int:
    """Matrix-multiply FLOPs of one round's forward and backward passes, all clients.

    Per layer and example: 2·in·out forward, 2·in·out for the weight gradient, and 2·in·out
    for the input gradient except at the first layer (its input needs none). Bias, activation,
    loss and update FLOPs are left out.
    """
    pairs = list(itertools.pairwise(cfg.widths))
    per_example = sum(6 * i * o for i, o in pairs) - 2 * pairs[0][0] * pairs[0][1]
    return per_example * cfg.batch * cfg.steps * cfg.clients


def client_data(cfg: FedConfig) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic float32 inputs and one-hot labels, [clients, (steps,) batch, features]."""
    rng = np.random.default_rng(0)
    lead = (cfg.clients, cfg.local_steps) if cfg.algo == "fedavg" else (cfg.clients,)
    x = rng.standard_normal((*lead, cfg.batch, cfg.widths[0]), dtype=np.float32)
    labels = rng.integers(0, cfg.widths[-1], size=(*lead, cfg.batch))
    y = np.eye(cfg.widths[-1], dtype=np.float32)[labels]
    return x, y


def torch_model(widths: tuple[int, ...]) -> Any:
    """`nn.Sequential` of Linear layers with ReLU between them, seeded initialisation."""
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for index, (i, o) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(i, o))
    return torch.nn.Sequential(*layers)


def torch_loss(logits: Any, y: Any) -> Any:
    """Softmax cross-entropy against one-hot (or soft) labels, averaged over the batch."""
    import torch

    return -(y * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def jax_mlp(params: Mapping[str, Any], x: Any) -> Any:
    """The `torch_model` network as a JAX function of its `named_parameters()` dict."""
    import jax

    layers = len(params) // 2
    h = x
    for index in range(layers):
        h = h @ params[f"{2 * index}.weight"].T + params[f"{2 * index}.bias"]
        if index < layers - 1:
            h = jax.nn.relu(h)
    return h


def jax_loss(params: Mapping[str, Any], batch: tuple[Any, Any]) -> Any:
    """Softmax cross-entropy of `jax_mlp` on one (inputs, one-hot labels) batch."""
    import jax

    x, y = batch
    return -(y * jax.nn.log_softmax(jax_mlp(params, x))).sum(axis=-1).mean()


def jax_client_update(params: Mapping[str, Any], data: tuple[Any, Any], *, lr: float) -> Any:
    """The parameter delta after one SGD step per batch of `data` ([steps, batch, ...])."""
    import jax

    def step(p: Any, batch: tuple[Any, Any]) -> tuple[Any, None]:
        grads = jax.grad(jax_loss)(p, batch)
        return jax.tree.map(lambda a, g: a - lr * g, p, grads), None

    final, _ = jax.lax.scan(step, params, data)
    return jax.tree.map(lambda a, b: a - b, final, params)


def torch_client_data(cfg: FedConfig, device: str = "cpu") -> tuple[Any, Any]:
    """`client_data` as torch tensors on `device`."""
    import torch

    # Cloned so that the tensors come from torch's allocator (64-byte aligned), as a user's
    # tensors would; numpy's buffers may be less aligned and force a copy at the boundary.
    x, y = client_data(cfg)
    return torch.from_numpy(x).clone().to(device), torch.from_numpy(y).clone().to(device)


def build_torch_loop(cfg: FedConfig) -> Callable[[], Any]:
    """One round as a Python loop over clients with an `nn.Module` and `torch.optim.SGD`."""
    import torch

    model = torch_model(cfg.widths)
    xs, ys = torch_client_data(cfg, "cpu")
    server = list(model.parameters())
    if cfg.algo == "fedsgd":
        optimizer = torch.optim.SGD(server, lr=cfg.lr)

        def fedsgd_round() -> Any:
            optimizer.zero_grad()
            for c in range(cfg.clients):
                (torch_loss(model(xs[c]), ys[c]) / cfg.clients).backward()
            optimizer.step()
            return server

        return fedsgd_round

    local = copy.deepcopy(model)
    local_params = list(local.parameters())
    local_optimizer = torch.optim.SGD(local_params, lr=cfg.lr)
    delta_sum = [torch.zeros_like(p) for p in server]

    def fedavg_round() -> Any:
        with torch.no_grad():
            for d in delta_sum:
                d.zero_()
        for c in range(cfg.clients):
            with torch.no_grad():
                for lp, p in zip(local_params, server, strict=True):
                    lp.copy_(p)
            for k in range(cfg.local_steps):
                local_optimizer.zero_grad()
                torch_loss(local(xs[c, k]), ys[c, k]).backward()
                local_optimizer.step()
            with torch.no_grad():
                for d, lp, p in zip(delta_sum, local_params, server, strict=True):
                    d.add_(lp).sub_(p)
        with torch.no_grad():
            for p, d in zip(server, delta_sum, strict=True):
                p.add_(d, alpha=1.0 / cfg.clients)
        return server

    return fedavg_round


def build_torch_vmap(cfg: FedConfig, device: str = "cpu") -> Callable[[], Any]:
    """One round with `torch.func.vmap` over clients of `functional_call` on `device`."""
    import torch
    from torch.func import functional_call, grad, vmap

    model = torch_model(cfg.widths).to(device)
    xs, ys = torch_client_data(cfg, device)
    params = dict(model.named_parameters())

    def loss_fn(p: dict[str, Any], x: Any, y: Any) -> Any:
        return torch_loss(functional_call(model, p, (x,)), y)

    if cfg.algo == "fedsgd":
        optimizer = torch.optim.SGD(params.values(), lr=cfg.lr)
        client_losses = vmap(loss_fn, in_dims=(None, 0, 0))

        def fedsgd_round() -> Any:
            optimizer.zero_grad()
            client_losses(params, xs, ys).mean().backward()
            optimizer.step()
            return list(params.values())

        return fedsgd_round

    server = {name: p.detach() for name, p in params.items()}
    loss_grad = grad(loss_fn)

    def client_update(p: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
        local = p
        for k in range(cfg.local_steps):
            g = loss_grad(local, x[k], y[k])
            local = {name: local[name] - cfg.lr * g[name] for name in local}
        return {name: local[name] - p[name] for name in p}

    client_deltas = vmap(client_update, in_dims=(None, 0, 0))

    def fedavg_round() -> Any:
        deltas = client_deltas(server, xs, ys)
        with torch.no_grad():
            for name, p in server.items():
                p.add_(deltas[name].mean(dim=0))
        return list(server.values())

    return fedavg_round


def build_drjax(cfg: FedConfig) -> Callable[[], Any]:
    """One round written with `drjax` in pure JAX: a single jitted function of the state."""
    import drjax
    import jax
    import jax.numpy as jnp

    model = torch_model(cfg.widths)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    x, y = client_data(cfg)
    data = (jnp.asarray(x), jnp.asarray(y))

    @drjax.program(placements={"clients": cfg.clients})
    def mean_loss(p: Any, batches: tuple[Any, Any]) -> Any:
        placed = drjax.broadcast(p)
        return drjax.reduce_mean(drjax.map_fn(jax_loss, (placed, batches)))

    @drjax.program(placements={"clients": cfg.clients})
    def mean_delta(p: Any, batches: tuple[Any, Any]) -> Any:
        placed = drjax.broadcast(p)
        update = functools.partial(jax_client_update, lr=cfg.lr)
        return drjax.reduce_mean(drjax.map_fn(update, (placed, batches)))

    if cfg.algo == "fedsgd":

        def step(p: Any, batches: tuple[Any, Any]) -> Any:
            grads = jax.grad(mean_loss)(p, batches)
            return jax.tree.map(lambda a, g: a - cfg.lr * g, p, grads)

    else:

        def step(p: Any, batches: tuple[Any, Any]) -> Any:
            return jax.tree.map(lambda a, d: a + d, p, mean_delta(p, batches))

    jitted = jax.jit(step)
    state = [params]

    def drjax_round() -> Any:
        state[0] = jitted(state[0], data)
        return state[0]

    return drjax_round


def build_bridge_mr(cfg: FedConfig, device: str = "cpu") -> Callable[[], Any]:
    """One round from torch through `bridge_mr.map_reduce` on `device`."""
    import torch

    from bridge_mr import map_reduce

    model = torch_model(cfg.widths).to(device)
    xs, ys = torch_client_data(cfg, device)
    params = dict(model.named_parameters())
    if cfg.algo == "fedsgd":
        optimizer = torch.optim.SGD(params.values(), lr=cfg.lr)

        def fedsgd_round() -> Any:
            optimizer.zero_grad()
            loss = map_reduce(jax_loss, params, (xs, ys), reduce="mean")
            loss.backward()
            optimizer.step()
            return list(params.values())

        return fedsgd_round

    update = functools.partial(jax_client_update, lr=cfg.lr)

    def fedavg_round() -> Any:
        with torch.no_grad():
            delta = map_reduce(update, params, (xs, ys), reduce="mean")
            for name, p in params.items():
                p.add_(delta[name])
        return list(params.values())

    return fedavg_round


def _xla_device() -> str:
    import torch_xla

    return str(torch_xla.device())


BUILDERS: dict[str, Callable[[FedConfig], Callable[[], Any]]] = {
    "torch_loop": build_torch_loop,
    "torch_vmap": build_torch_vmap,
    "drjax": build_drjax,
    "bridge_mr": build_bridge_mr,
    "torch_xla": lambda cfg: build_torch_vmap(cfg, _xla_device()),
    "bridge_mr_xla": lambda cfg: build_bridge_mr(cfg, _xla_device()),
}


def build(alternative: str, cfg: FedConfig) -> Callable[[], Any] | str:
    """The round of `alternative` for `cfg`, or why it cannot be built here (a string)."""
    try:
        return BUILDERS[alternative](cfg)
    except ImportError as err:
        return f"not available: {err}"
