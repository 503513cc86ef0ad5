"""The federated MLP rounds (the "fedsgd", "fedavg", "scaling" and "limits" cases, torch-xla).

A round is the same computation in every alternative, started from the same parameters and
data:

* FedSGD: the mean over clients of each client's loss on its batch, its gradient with respect
  to the server parameters, one SGD step on the server.
* FedAvg: each client starts from the server parameters and runs `local_steps` SGD steps on its
  own batches; the server adds the mean of the clients' parameter deltas (`fedavg`'s rounds).

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

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import fedavg

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

    @property
    def row_id(self) -> str:
        """The round's name in result tables: "<algo>/<model>/c<clients>"."""
        return f"{self.algo}/{self.model}/c{self.clients}"

    def params(self) -> dict[str, Any]:
        """The round's fields, steps per client and parameter count, for a result row."""
        return {
            **dataclasses.asdict(self),
            "steps_per_client": self.steps,
            "n_params": n_params(self.widths),
        }


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


def torch_client_data(cfg: FedConfig, device: str = "cpu") -> tuple[Any, Any]:
    """`client_data` as torch tensors on `device`."""
    import torch

    # Cloned so that the tensors come from torch's allocator (64-byte aligned), as a user's
    # tensors would; numpy's buffers may be less aligned and force a copy at the boundary.
    x, y = client_data(cfg)
    return torch.from_numpy(x).clone().to(device), torch.from_numpy(y).clone().to(device)


def client_update(cfg: FedConfig) -> Callable[[Any, Any], Any]:
    """The JAX client function (params, data) -> delta: one SGD step of `jax_loss` per batch of
    `data` ([steps, batch, ...]), a rolled `lax.scan`."""
    return fedavg.local_sgd(jax_loss, cfg.lr)


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

    return fedavg.torch_fedavg_loop(
        model,
        cfg.clients,
        cfg.local_steps,
        cfg.lr,
        lambda local, c, k: torch_loss(local(xs[c, k]), ys[c, k]),
    )


def build_torch_vmap(cfg: FedConfig, device: str = "cpu") -> Callable[[], Any]:
    """One round with `torch.func.vmap` over clients of `functional_call` on `device`."""
    import torch
    from torch.func import functional_call, vmap

    model = torch_model(cfg.widths).to(device)
    xs, ys = torch_client_data(cfg, device)
    params = dict(model.named_parameters())

    def loss_fn(p: dict[str, Any], batch: tuple[Any, Any]) -> Any:
        x, y = batch
        return torch_loss(functional_call(model, p, (x,)), y)

    if cfg.algo == "fedavg":
        server = {name: p.detach() for name, p in params.items()}
        return fedavg.torch_vmap_fedavg(
            server, (xs, ys), loss_fn, local_steps=cfg.local_steps, lr=cfg.lr
        )
    optimizer = torch.optim.SGD(params.values(), lr=cfg.lr)
    client_losses = vmap(lambda p, x, y: loss_fn(p, (x, y)), in_dims=(None, 0, 0))

    def fedsgd_round() -> Any:
        optimizer.zero_grad()
        client_losses(params, xs, ys).mean().backward()
        optimizer.step()
        return list(params.values())

    return fedsgd_round


def build_drjax(cfg: FedConfig) -> Callable[[], Any]:
    """One round written with `drjax` in pure JAX: a single jitted function of the state."""
    import drjax
    import jax
    import jax.numpy as jnp

    model = torch_model(cfg.widths)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    x, y = client_data(cfg)
    data = (jnp.asarray(x), jnp.asarray(y))
    if cfg.algo == "fedavg":
        return fedavg.drjax_fedavg(client_update(cfg), cfg.clients, params, data)

    @drjax.program(placements={"clients": cfg.clients})
    def mean_loss(p: Any, batches: tuple[Any, Any]) -> Any:
        placed = drjax.broadcast(p)
        return drjax.reduce_mean(drjax.map_fn(jax_loss, (placed, batches)))

    def step(p: Any, batches: tuple[Any, Any]) -> Any:
        grads = jax.grad(mean_loss)(p, batches)
        return jax.tree.map(lambda a, g: a - cfg.lr * g, p, grads)

    return fedavg.jax_round(jax.jit(step), params, data)


def build_bridge_mr(cfg: FedConfig, device: str = "cpu") -> Callable[[], Any]:
    """One round from torch through `bridge_mr.map_reduce` on `device`."""
    import torch

    from bridge_mr import map_reduce

    model = torch_model(cfg.widths).to(device)
    xs, ys = torch_client_data(cfg, device)
    params = dict(model.named_parameters())
    if cfg.algo == "fedavg":
        return fedavg.bridge_mr_fedavg(client_update(cfg), params, (xs, ys))
    optimizer = torch.optim.SGD(params.values(), lr=cfg.lr)

    def fedsgd_round() -> Any:
        optimizer.zero_grad()
        loss = map_reduce(jax_loss, params, (xs, ys), reduce="mean")
        loss.backward()
        optimizer.step()
        return list(params.values())

    return fedsgd_round


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


def build_fed(alternative: str, cfg: FedConfig) -> Callable[[], Any] | str:
    """The round of `alternative` for `cfg`, or why it cannot be built here (a string)."""
    try:
        return BUILDERS[alternative](cfg)
    except ImportError as err:
        return f"not available: {err}"
