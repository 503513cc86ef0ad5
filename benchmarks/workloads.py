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

    return torch_fedavg_loop(
        model,
        cfg.clients,
        cfg.local_steps,
        cfg.lr,
        lambda local, c, k: torch_loss(local(xs[c, k]), ys[c, k]),
    )


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


def build(alternative: str, cfg: FedConfig | RoundConfig) -> Callable[[], Any] | str:
    """The round of `alternative` for `cfg`, or why it cannot be built here (a string).

    A `RoundConfig` (a model round) goes to `build_round`.
    """
    if isinstance(cfg, RoundConfig):
        return build_round(alternative, cfg)
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


# Model rounds (the "cnn" and "lm" cases): FedAvg rounds of models FL users train.
#
# * "cnn": pfl-research's CIFAR10 `simple_cnn` (conv 3->32 3x3, conv 32->64 3x3, both VALID and
#   ReLU, max-pool 2x2, flatten 12544 -> dense 128 (ReLU) -> dense 10; 1,626,442 parameters) on
#   synthetic CIFAR-shaped data (NCHW float32 [3, 32, 32], 10 classes). pfl's model also has
#   dropout (0.25 after the pool, 0.5 after dense 128); it is left out here so that every
#   alternative computes the same, deterministic round.
# * "lm": a 2-layer pre-LayerNorm transformer LM (d_model 128, 4 heads, MLP 512, exact GELU,
#   learned positions, byte-level vocabulary of 256), next-token cross-entropy on windows of the
#   Python standard library's own source files read as bytes (nothing downloaded).
#
# Both use torch's layouts on both sides (Conv2d weight [out, in, kh, kw], NCHW activations,
# Linear weight [out, in]), so `dict(module.named_parameters())` is the JAX functions' tree.
# Client data: a tuple of arrays [clients, local_steps, batch, ...]; one SGD step per batch.

#: Alternatives of the model rounds, besides those `ROUND_STRATEGIES` adds.
ROUND_ALTERNATIVES = (
    "bridge_mr",
    "bridge_mr_rolled",
    "xla_per_client",
    "drjax",
    "torch_vmap",
    "torch_loop",
)

#: `bridge_mr.map_reduce`'s `strategy=` values timed as "bridge_mr:<strategy>" where it has one.
STRATEGIES = ("vmap", "per_client", "chunks", "auto")


def map_reduce_strategies() -> tuple[str, ...]:
    """The `STRATEGIES` this bridge_mr's `map_reduce` accepts (none before it has `strategy=`)."""
    import inspect

    import bridge_mr

    if "strategy" not in inspect.signature(bridge_mr.map_reduce).parameters:
        return ()
    return STRATEGIES


def round_alternatives() -> tuple[str, ...]:
    """`ROUND_ALTERNATIVES` plus "bridge_mr:<strategy>" for each strategy map_reduce accepts
    other than its default (which is what "bridge_mr" runs)."""
    import inspect

    import bridge_mr

    strategies = map_reduce_strategies()
    if not strategies:
        return ROUND_ALTERNATIVES
    default = inspect.signature(bridge_mr.map_reduce).parameters["strategy"].default
    return ROUND_ALTERNATIVES + tuple(f"bridge_mr:{s}" for s in strategies if s != default)


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """One FedAvg round of a model of `ROUND_MODELS`: plain mean of client deltas.

    Attributes:
      model: "cnn" or "lm".
      clients: clients in the round.
      batch: examples (cnn) or sequences (lm) per client per step.
      local_steps: SGD steps per client (one local epoch: local_steps * batch examples).
      lr: the clients' SGD learning rate.
      seq: lm only: tokens per sequence (the model predicts seq tokens from seq + 1 bytes).
      chunk_size: `chunk_size=` of the "bridge_mr:chunks" alternative.
    """

    model: str
    clients: int
    batch: int = 10
    local_steps: int = 5
    lr: float = 0.05
    seq: int = 64
    chunk_size: int = 8

    @property
    def row_id(self) -> str:
        """The round's name in result tables: "fedavg/<model>/c<clients>"."""
        return f"fedavg/{self.model}/c{self.clients}"

    def params(self) -> dict[str, Any]:
        """The round's fields and parameter count, for a result row."""
        return {
            **dataclasses.asdict(self),
            "examples_per_client": self.batch * self.local_steps,
            "n_params": sum(p.numel() for p in round_torch_model(self).parameters()),
        }


def round_config(model: str, clients: int, **fields: Any) -> RoundConfig:
    """The case's round of `model`: cnn 50 examples per client (5 steps of 10, pfl's CIFAR10
    setup), lm 4 steps of 8 sequences of 64 bytes."""
    defaults = {"cnn": {}, "lm": {"batch": 8, "local_steps": 4}}[model]
    return RoundConfig(model, clients, **{**defaults, **fields})


def _stdlib_bytes(count: int) -> np.ndarray:
    """The first `count` bytes of the standard library's .py files, sorted by path."""
    import pathlib
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= count:
            break
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if data.size < count:  # A small stdlib: repeat it.
        data = np.tile(data, -(-count // data.size))
    return data[:count]


def round_data(cfg: RoundConfig) -> tuple[np.ndarray, ...]:
    """The round's client data as numpy arrays [clients, local_steps, batch, ...] (seeded).

    cnn: (inputs float32 [..., 3, 32, 32] standard normal, one-hot labels float32 [..., 10]);
    lm: (byte tokens int32 [..., seq + 1],): consecutive windows of the stdlib's sources, so
    each client reads its own stretch of files.
    """
    lead = (cfg.clients, cfg.local_steps, cfg.batch)
    if cfg.model == "cnn":
        rng = np.random.default_rng(0)
        x = rng.standard_normal((*lead, 3, 32, 32), dtype=np.float32)
        labels = rng.integers(0, 10, size=lead)
        return x, np.eye(10, dtype=np.float32)[labels]
    if cfg.model == "lm":
        width = cfg.seq + 1
        tokens = _stdlib_bytes(int(np.prod(lead)) * width).astype(np.int32)
        return (tokens.reshape(*lead, width),)
    raise ValueError(f"unknown model {cfg.model!r}")


def _torch_lm(seq: int, d: int = 128, heads: int = 4, layers: int = 2, vocab: int = 256) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (
                z.reshape(b, t, heads, d // heads).transpose(1, 2)
                for z in self.qkv(self.ln1(x)).split(d, dim=-1)
            )
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(0.02 * torch.randn(seq, d))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.tok(tokens) + self.pos[: tokens.shape[-1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return TinyLM()


def round_torch_model(cfg: RoundConfig) -> Any:
    """The round's torch model, seeded initialisation (torch's defaults)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if cfg.model == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(12544, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
    return _torch_lm(cfg.seq)


def round_torch_loss(model_name: str, forward: Callable[[Any], Any], batch: tuple[Any, ...]) -> Any:
    """The batch loss in torch; `forward` maps the model's input to its logits."""
    import torch

    if model_name == "cnn":
        x, y = batch
        return torch_loss(forward(x), y)
    (tokens,) = batch
    logp = torch.log_softmax(forward(tokens[..., :-1]), dim=-1)
    return -logp.gather(-1, tokens[..., 1:].long().unsqueeze(-1)).mean()


def jax_cnn(params: Mapping[str, Any], x: Any, *, reduce_window: bool = False) -> Any:
    """`round_torch_model("cnn")` in JAX: NCHW `lax.conv_general_dilated`, OIHW kernels.

    The 2x2 max-pool is a reshape and a max, or (`reduce_window`) `lax.reduce_window`, as
    flax's `nn.max_pool` and torchax's `max_pool2d` write it (its gradient: select_and_scatter).
    """
    import jax
    from jax import lax

    def conv(h: Any, name: str) -> Any:
        out = lax.conv_general_dilated(
            h, params[f"{name}.weight"], (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return jax.nn.relu(out + params[f"{name}.bias"][:, None, None])

    h = conv(conv(x, "0"), "2")
    *lead, c, height, width = h.shape
    if reduce_window:
        window = (1,) * (h.ndim - 2) + (2, 2)
        h = lax.reduce_window(h, np.array(-np.inf, h.dtype), lax.max, window, window, "VALID")
    else:
        h = h.reshape(*lead, c, height // 2, 2, width // 2, 2).max(axis=(-3, -1))
    h = h.reshape(*lead, -1)
    h = jax.nn.relu(h @ params["6.weight"].T + params["6.bias"])
    return h @ params["8.weight"].T + params["8.bias"]


def jax_lm(params: Mapping[str, Any], tokens: Any, *, heads: int = 4) -> Any:
    """`round_torch_model("lm")` in JAX."""
    import jax
    import jax.numpy as jnp

    def layer_norm(h: Any, name: str) -> Any:
        mean = h.mean(axis=-1, keepdims=True)
        var = ((h - mean) ** 2).mean(axis=-1, keepdims=True)
        normed = (h - mean) / jnp.sqrt(var + 1e-5)
        return normed * params[f"{name}.weight"] + params[f"{name}.bias"]

    def linear(h: Any, name: str) -> Any:
        return h @ params[f"{name}.weight"].T + params[f"{name}.bias"]

    t = tokens.shape[-1]
    x = params["tok.weight"][tokens] + params["pos"][:t]
    d = x.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    blocks = sorted({int(n.split(".")[1]) for n in params if n.startswith("blocks.")})
    for index in blocks:
        p = f"blocks.{index}"
        q, k, v = (
            jnp.swapaxes(z.reshape(*z.shape[:-1], heads, d // heads), -2, -3)
            for z in jnp.split(linear(layer_norm(x, f"{p}.ln1"), f"{p}.qkv"), 3, axis=-1)
        )
        att = (q @ jnp.swapaxes(k, -1, -2)) * (d // heads) ** -0.5
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        y = jnp.swapaxes(att @ v, -2, -3).reshape(x.shape)
        x = x + linear(y, f"{p}.proj")
        h = jax.nn.gelu(linear(layer_norm(x, f"{p}.ln2"), f"{p}.fc1"), approximate=False)
        x = x + linear(h, f"{p}.fc2")
    return linear(layer_norm(x, "ln_f"), "head")


def round_jax_loss(model_name: str) -> Callable[[Mapping[str, Any], tuple[Any, ...]], Any]:
    """The batch loss in JAX of `model_name`, as a function of (params, batch)."""
    import jax
    import jax.numpy as jnp

    def cnn_loss(params: Mapping[str, Any], batch: tuple[Any, ...]) -> Any:
        x, y = batch
        return -(y * jax.nn.log_softmax(jax_cnn(params, x))).sum(axis=-1).mean()

    def lm_loss(params: Mapping[str, Any], batch: tuple[Any, ...]) -> Any:
        (tokens,) = batch
        logp = jax.nn.log_softmax(jax_lm(params, tokens[..., :-1]))
        return -jnp.take_along_axis(logp, tokens[..., 1:, None], axis=-1).mean()

    return {"cnn": cnn_loss, "lm": lm_loss}[model_name]


def round_client_update(cfg: RoundConfig, *, unroll: bool = True) -> Callable[..., Any]:
    """The JAX client function (params, data) -> delta: local SGD steps under `lax.scan`.

    `unroll=True` unrolls the steps (XLA:CPU lays out backward convolutions badly inside a
    loop: the issue measured 1.6 s unrolled against 5.2 s rolled for the CNN at 8 clients).
    """
    import jax

    loss = round_jax_loss(cfg.model)

    def update(params: Any, data: tuple[Any, ...]) -> Any:
        def step(p: Any, batch: tuple[Any, ...]) -> tuple[Any, None]:
            grads = jax.grad(loss)(p, batch)
            return jax.tree.map(lambda a, g: a - cfg.lr * g, p, grads), None

        final, _ = jax.lax.scan(step, params, data, unroll=unroll)
        return jax.tree.map(lambda a, b: a - b, final, params)

    return update


def _round_torch_data(cfg: RoundConfig) -> tuple[Any, ...]:
    import torch

    return tuple(torch.from_numpy(a).clone() for a in round_data(cfg))


def round_jax_state(cfg: RoundConfig) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The round's initial parameters (`round_torch_model`'s) and data, as JAX arrays."""
    import jax.numpy as jnp

    model = round_torch_model(cfg)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    return params, tuple(jnp.asarray(a) for a in round_data(cfg))


def build_round_torch_loop(cfg: RoundConfig) -> Callable[[], Any]:
    """The round as a Python loop over clients and steps: `nn.Module`, `torch.optim.SGD`."""
    data = _round_torch_data(cfg)
    return torch_fedavg_loop(
        round_torch_model(cfg),
        cfg.clients,
        cfg.local_steps,
        cfg.lr,
        lambda local, c, k: round_torch_loss(cfg.model, local, tuple(a[c, k] for a in data)),
    )


def build_round_torch_vmap(cfg: RoundConfig) -> Callable[[], Any]:
    """The round with `torch.func.vmap` over clients of `grad` of `functional_call`."""
    import torch
    from torch.func import functional_call, grad, vmap

    model = round_torch_model(cfg)
    data = _round_torch_data(cfg)
    server = {name: p.detach() for name, p in model.named_parameters()}

    def loss_fn(p: dict[str, Any], batch: tuple[Any, ...]) -> Any:
        return round_torch_loss(cfg.model, lambda x: functional_call(model, p, (x,)), batch)

    loss_grad = grad(loss_fn)

    def client_update(p: dict[str, Any], client: tuple[Any, ...]) -> dict[str, Any]:
        local = p
        for k in range(cfg.local_steps):
            g = loss_grad(local, tuple(a[k] for a in client))
            local = {name: local[name] - cfg.lr * g[name] for name in local}
        return {name: local[name] - p[name] for name in p}

    client_deltas = vmap(client_update, in_dims=(None, 0))

    def torch_vmap_round() -> Any:
        deltas = client_deltas(server, data)
        with torch.no_grad():
            for name, p in server.items():
                p.add_(deltas[name].mean(dim=0))
        return list(server.values())

    return torch_vmap_round


def build_round_drjax(cfg: RoundConfig) -> Callable[[], Any]:
    """The round with `drjax` in pure JAX (unrolled local steps): one jitted function."""
    import drjax
    import jax

    params, data = round_jax_state(cfg)
    update = round_client_update(cfg, unroll=True)

    @drjax.program(placements={"clients": cfg.clients})
    def mean_delta(p: Any, client_data: tuple[Any, ...]) -> Any:
        return drjax.reduce_mean(drjax.map_fn(update, (drjax.broadcast(p), client_data)))

    jitted = jax.jit(lambda p, d: jax.tree.map(lambda a, b: a + b, p, mean_delta(p, d)))
    state = [params]

    def drjax_round() -> Any:
        state[0] = jitted(state[0], data)
        return state[0]

    return drjax_round


def build_round_xla_per_client(cfg: RoundConfig) -> Callable[[], Any]:
    """The per-client XLA floor: one jitted single-client program (update, accumulated into
    the delta sum in XLA) called per client from Python, then one jitted server step."""
    import jax
    import jax.numpy as jnp

    params, data = round_jax_state(cfg)
    clients = [tuple(a[c] for a in data) for c in range(cfg.clients)]  # Sliced once, as views.
    update = round_client_update(cfg, unroll=True)
    # The XLA options bridge_mr compiles the same CPU program with (convolutions: no YNN fusion).
    from bridge_mr import jax_core

    options = jax_core.cpu_compiler_options(jax.make_jaxpr(update)(params, clients[0]))
    accumulate = jax.jit(
        lambda total, p, d: jax.tree.map(jnp.add, total, update(p, d)),
        donate_argnums=0,
        compiler_options=options or None,
    )
    apply = jax.jit(lambda p, total: jax.tree.map(lambda a, t: a + t / cfg.clients, p, total))
    state = [params]

    def xla_per_client_round() -> Any:
        total = jax.tree.map(jnp.zeros_like, state[0])
        for client in clients:
            total = accumulate(total, state[0], client)
        state[0] = apply(state[0], total)
        return state[0]

    return xla_per_client_round


def build_round_bridge_mr(
    cfg: RoundConfig, *, unroll: bool = True, strategy: str | None = None
) -> Callable[[], Any]:
    """The round from torch through `bridge_mr.map_reduce` (a JAX client function).

    `strategy`: passed as `strategy=` (and `chunk_size=cfg.chunk_size` for "chunks") where
    map_reduce accepts it; None: map_reduce's default.
    """
    import torch

    from bridge_mr import map_reduce

    model = round_torch_model(cfg)
    data = _round_torch_data(cfg)
    params = dict(model.named_parameters())
    update = round_client_update(cfg, unroll=unroll)
    options: dict[str, Any] = {}
    if strategy is not None:
        options["strategy"] = strategy
        if strategy == "chunks":
            options["chunk_size"] = cfg.chunk_size

    def bridge_mr_round() -> Any:
        with torch.no_grad():
            delta = map_reduce(update, params, data, reduce="mean", **options)
            for name, p in params.items():
                p.add_(delta[name])
        return list(params.values())

    return bridge_mr_round


def _round_builder(alternative: str) -> Callable[[RoundConfig], Callable[[], Any]]:
    builders: dict[str, Callable[[RoundConfig], Callable[[], Any]]] = {
        "bridge_mr": build_round_bridge_mr,
        "bridge_mr_rolled": functools.partial(build_round_bridge_mr, unroll=False),
        "xla_per_client": build_round_xla_per_client,
        "drjax": build_round_drjax,
        "torch_vmap": build_round_torch_vmap,
        "torch_loop": build_round_torch_loop,
    }
    if alternative.startswith("bridge_mr:"):
        return functools.partial(build_round_bridge_mr, strategy=alternative.split(":", 1)[1])
    return builders[alternative]


def build_round(alternative: str, cfg: RoundConfig) -> Callable[[], Any] | str:
    """The model round of `alternative` for `cfg`, or why it cannot be built here (a string)."""
    if alternative.startswith("bridge_mr:"):
        strategy = alternative.split(":", 1)[1]
        if strategy not in map_reduce_strategies():
            return f"not available: bridge_mr.map_reduce has no strategy={strategy!r}"
    try:
        return _round_builder(alternative)(cfg)
    except ImportError as err:
        return f"not available: {err}"
