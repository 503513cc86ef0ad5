"""What the benchmarks run: federated rounds, per-call overhead contestants, tensor exchanges.

Everything here uses bridge_mr's public names only (`bridge_mr.map_reduce`, `torch_function`,
`jax_core`, `dlpack`), so the numbers move only when the library does.

Federated workloads: MLP models, synthetic client data, and one training round per alternative.

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


# Per-call overhead (the "overhead" case): a one-hidden-layer tanh MLP with one output and a
# squared-error loss, small enough that the bridge's own cost per call shows.


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


def _floor_node() -> Any:
    """An autograd node that computes nothing: forward and backward only allocate results."""
    import torch

    class FloorNode(torch.autograd.Function):
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
            return (None, *(None if s is None else torch.empty(s) for s in ctx.shapes[1:]))

    return FloorNode


def autograd_floor(
    params: Mapping[str, Any], others: list[Any], out_shape: tuple[int, ...], cotangent: Any
) -> Callable[[], None]:
    """torch's own cost of one bridge node over `params` (needing grads) and `others`.

    One custom autograd node with those tensor inputs and an output of `out_shape`, whose
    forward and backward only allocate their results: floor + pure JAX bounds any bridge
    from below.
    """
    import torch

    node = _floor_node()
    shapes = (out_shape, *(tuple(p.shape) for p in params.values()), *(None for _ in others))
    tensors = [*params.values(), *others]

    def floor() -> None:
        for p in params.values():
            p.grad = None
        torch.autograd.backward(node.apply(shapes, *tensors), cotangent)

    return floor


def map_reduce_contestants(clients: int, width: int, batch: int) -> dict[str, Callable[[], Any]]:
    """FedSGD forward+backward (mean client loss, gradients) four ways, no optimizer step.

    The contestants return None: each waits for its own results, and the per-call cost of
    syncing returned trees would add to what these rows measure.

    "bridge map_reduce": `bridge_mr.map_reduce` from torch, gradients left in `.grad`;
    "pure JAX": `jax.jit(jax.value_and_grad(...))` of the same `bridge_mr.jax_core` program;
    "torch autograd floor": `autograd_floor` with the bridge's inputs and output;
    "pure torch loop": the same MLP in torch, a Python loop over the clients.
    """
    import jax
    import jax.numpy as jnp
    import torch

    import bridge_mr
    from bridge_mr import jax_core

    params_np, data_np = overhead_data(clients, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True) for k, v in params_np.items()}
    t_data = {k: torch.tensor(v) for k, v in data_np.items()}
    j_params = {k: jnp.asarray(v) for k, v in params_np.items()}
    j_data = {k: jnp.asarray(v) for k, v in data_np.items()}

    def bridge() -> None:
        for p in t_params.values():
            p.grad = None
        bridge_mr.map_reduce(overhead_loss, t_params, t_data).backward()

    def program(params: Mapping[str, Any], data: Mapping[str, Any]) -> Any:
        with jax_core.program(placements={"clients": clients}):
            placed = jax_core.broadcast(params)
            return jax_core.reduce_mean(jax_core.map_fn(overhead_loss, (placed, data)))

    value_and_grad = jax.jit(jax.value_and_grad(program))

    def pure_jax() -> None:
        jax.block_until_ready(value_and_grad(j_params, j_data))

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
        "bridge map_reduce": bridge,
        "pure JAX": pure_jax,
        "torch autograd floor": autograd_floor(t_params, list(t_data.values()), (), None),
        "pure torch loop": pure_torch,
    }


def torch_function_contestants(width: int, batch: int) -> dict[str, Callable[[], Any]]:
    """The MLP's forward+backward with a [batch, 1] output (residuals saved), four ways.

    The contestants return None, as `map_reduce_contestants`' do.

    "bridge torch_function": `bridge_mr.torch_function(overhead_mlp)`, VJP in backward;
    "pure JAX pair": the jitted forward-with-VJP, then the jitted VJP;
    "torch autograd floor": `autograd_floor` with the bridge's inputs and output;
    "pure torch": the same MLP in torch.
    """
    import jax
    import jax.numpy as jnp
    import torch

    import bridge_mr

    params_np, data_np = overhead_data(1, width, batch)
    t_params = {k: torch.tensor(v, requires_grad=True) for k, v in params_np.items()}
    t_x = torch.tensor(data_np["x"][0])
    j_params = {k: jnp.asarray(v) for k, v in params_np.items()}
    j_x = jnp.asarray(data_np["x"][0])
    f = bridge_mr.torch_function(overhead_mlp)
    t_ct = torch.ones(batch, 1)
    j_ct = jnp.ones((batch, 1), jnp.float32)

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

    def pure_jax() -> None:
        _, vjp = forward(j_params, j_x)
        jax.block_until_ready(backward(vjp, j_ct))

    def pure_torch() -> None:
        for p in t_params.values():
            p.grad = None
        _overhead_torch_mlp(t_params, t_x).backward(t_ct)

    return {
        "bridge torch_function": bridge,
        "pure JAX pair": pure_jax,
        "torch autograd floor": autograd_floor(t_params, [t_x], (batch, 1), t_ct),
        "pure torch": pure_torch,
    }


# Tensor exchange (the "boundary" case and `benchmarks.bench_dlpack`).


def dlpack_paths(tensors: list[Any], arrays: list[Any]) -> dict[str, dict[str, Callable[[], Any]]]:
    """Ways to move `tensors` into JAX ("import") and `arrays` into torch ("export").

    "bridge_mr": `bridge_mr.dlpack.import_tensors` / `export_arrays`; "public dlpack":
    `jax.dlpack.from_dlpack(t)` / `torch.from_dlpack(a)`; "numpy copy": a copy through host
    memory onto the other side's device (on CPU `jax.device_put(t.numpy())` would alias the
    buffer, so it is `jnp.asarray`).
    """
    import jax
    import jax.numpy as jnp
    import torch

    from bridge_mr import dlpack

    device = tensors[0].device
    if device.type == "cpu":
        import_copy = lambda: [jnp.asarray(t.numpy()) for t in tensors]
        export_copy = lambda: [torch.from_numpy(np.array(a)) for a in arrays]
    else:
        gpu = jax.devices("gpu")[device.index or 0]
        import_copy = lambda: [jax.device_put(t.cpu().numpy(), gpu) for t in tensors]
        export_copy = lambda: [torch.from_numpy(np.array(a)).to(device) for a in arrays]
    return {
        "import": {
            "bridge_mr": lambda: dlpack.import_tensors(tensors),
            "public dlpack": lambda: [jax.dlpack.from_dlpack(t) for t in tensors],
            "numpy copy": import_copy,
        },
        "export": {
            "bridge_mr": lambda: dlpack.export_arrays(arrays),
            "public dlpack": lambda: [torch.from_dlpack(a) for a in arrays],
            "numpy copy": export_copy,
        },
    }
