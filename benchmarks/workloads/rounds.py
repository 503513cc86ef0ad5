"""Model rounds (the "cnn" and "lm" cases): FedAvg rounds of models FL users train.

* "cnn": pfl-research's CIFAR10 `simple_cnn` (conv 3->32 3x3, conv 32->64 3x3, both VALID and
  ReLU, max-pool 2x2, flatten 12544 -> dense 128 (ReLU) -> dense 10; 1,626,442 parameters) on
  synthetic CIFAR-shaped data (NCHW float32 [3, 32, 32], 10 classes). pfl's model also has
  dropout (0.25 after the pool, 0.5 after dense 128); it is left out here so that every
  alternative computes the same, deterministic round.
* "lm": a 2-layer pre-LayerNorm transformer LM (d_model 128, 4 heads, MLP 512, exact GELU,
  learned positions, byte-level vocabulary of 256), next-token cross-entropy on windows of the
  Python standard library's own source files read as bytes (nothing downloaded).

Both use torch's layouts on both sides (Conv2d weight [out, in, kh, kw], NCHW activations,
Linear weight [out, in]), so `dict(module.named_parameters())` is the JAX functions' tree.
Client data: a tuple of arrays [clients, local_steps, batch, ...]; one SGD step per batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import fedavg
from .federated import torch_loss

#: Alternatives of the model rounds, besides those `round_alternatives` adds.
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
    return fedavg.local_sgd(round_jax_loss(cfg.model), cfg.lr, unroll=unroll)


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
    return fedavg.torch_fedavg_loop(
        round_torch_model(cfg),
        cfg.clients,
        cfg.local_steps,
        cfg.lr,
        lambda local, c, k: round_torch_loss(cfg.model, local, tuple(a[c, k] for a in data)),
    )


def build_round_torch_vmap(cfg: RoundConfig) -> Callable[[], Any]:
    """The round with `torch.func.vmap` over clients of `grad` of `functional_call`."""
    from torch.func import functional_call

    model = round_torch_model(cfg)
    server = {name: p.detach() for name, p in model.named_parameters()}

    def loss_fn(p: dict[str, Any], batch: tuple[Any, ...]) -> Any:
        return round_torch_loss(cfg.model, lambda x: functional_call(model, p, (x,)), batch)

    return fedavg.torch_vmap_fedavg(
        server, _round_torch_data(cfg), loss_fn, local_steps=cfg.local_steps, lr=cfg.lr
    )


def build_round_drjax(cfg: RoundConfig) -> Callable[[], Any]:
    """The round with `drjax` in pure JAX (unrolled local steps): one jitted function."""
    params, data = round_jax_state(cfg)
    return fedavg.drjax_fedavg(round_client_update(cfg, unroll=True), cfg.clients, params, data)


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

    def xla_per_client_step(p: Any, client_data: list[tuple[Any, ...]]) -> Any:
        total = jax.tree.map(jnp.zeros_like, p)
        for client in client_data:
            total = accumulate(total, p, client)
        return apply(p, total)

    return fedavg.jax_round(xla_per_client_step, params, clients)


def build_round_bridge_mr(
    cfg: RoundConfig, *, unroll: bool = True, strategy: str | None = None
) -> Callable[[], Any]:
    """The round from torch through `bridge_mr.map_reduce` (a JAX client function).

    `strategy`: passed as `strategy=` (and `chunk_size=cfg.chunk_size` for "chunks") where
    map_reduce accepts it; None: map_reduce's default.
    """
    params = dict(round_torch_model(cfg).named_parameters())
    options: dict[str, Any] = {}
    if strategy is not None:
        options["strategy"] = strategy
        if strategy == "chunks":
            options["chunk_size"] = cfg.chunk_size
    update = round_client_update(cfg, unroll=unroll)
    return fedavg.bridge_mr_fedavg(update, params, _round_torch_data(cfg), **options)


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
