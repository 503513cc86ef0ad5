"""The FedAvg round docs/algorithms.md tells a torch user to write, and what they would write
instead.

One round: every client starts from the server's parameters, takes `steps` SGD steps of
`batch` examples (its own data, in order), and the server adds the clients' mean delta
(`torch.optim.SGD(lr=1.0)` on minus that mean, FedAvg). Models (`MODELS`), written in torch:

* "cnn": pfl-research's CIFAR10 `simple_cnn` (its benchmarks' `model/pytorch/cnn.py`): two 3x3
  convolutions (32, 64), a 2x2 max-pool, dense 128 and 10, on NCHW 32x32 images (pfl's
  NHWC-to-NCHW transpose and its two dropouts left out: the alternatives draw dropout masks
  from different generators, so their rounds would not be comparable value for value).
* "gpt2": transformers' `GPT2LMHeadModel`, the model zoo's small config
  (`tests/helpers/zoo.py`: `zoo.TRANSFORMERS["gpt2"]`), its own `labels=` loss on token windows.
* "resnet18": transformers' `ResNetForImageClassification`, ResNet-18's layout (basic blocks,
  depths 2-2-2-2) at a quarter of its widths (16-32-64-128), its BatchNorms made to use batch
  statistics only (`torch.func.replace_all_batch_norm_modules_`, as torch.func asks for vmap).

Alternatives (`ALTERNATIVES`), each a zero-argument round returning the server parameters:

* "bridge_mr": the documented path (docs/algorithms.md),
  `alg.outer_step(alg.local_training(from_torch(loss), optax.sgd(lr), steps), params, batches)`
  then the server optimizer's step; "bridge_mr:NAME" passes `strategy=NAME`.
* "torch_loop": what a torch user writes: one local `nn.Module` that loads the server's state
  per client, a `torch.optim.SGD` per client, a plain loop over clients and steps.
* "torch_vmap": `torch.func.vmap` over clients of the local steps (`torch.func.grad` of
  `functional_call`).
* "pfl": pfl-research's `FederatedAveraging` on its `SimulatedBackend` and `PyTorchModel`
  (local SGD, central `SGD(lr=1.0)`), evaluation off; needs the `pfl` package (its own venv).

Importable without JAX or bridge_mr (the pfl venv has neither): they are imported where used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: The models, in the order the case measures them.
MODELS = ("cnn", "gpt2", "resnet18")
#: The alternatives' names ("bridge_mr:STRATEGY" is also accepted).
ALTERNATIVES = ("bridge_mr", "torch_loop", "pfl", "torch_vmap")

#: (params, batch) -> loss, where `call(*args, **kwargs)` runs the model.
ModelCall = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class UserConfig:
    """One round of the users' path.

    Attributes:
      model: one of `MODELS`.
      clients: clients in the round.
      steps: local SGD steps per client.
      batch: examples per step.
      lr: the clients' SGD learning rate.
    """

    model: str
    clients: int
    steps: int = 5
    batch: int = 10
    lr: float = 0.05

    @property
    def row_id(self) -> str:
        """The round's name in result tables: "users/<model>/c<clients>"."""
        return f"users/{self.model}/c{self.clients}"


def build_model(model: str) -> Any:
    """`model`'s torch module, seeded (`torch.manual_seed(0)`), in training mode."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Flatten(),
            nn.Linear(14 * 14 * 64, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        ).train()
    import transformers

    if model == "gpt2":
        from helpers import zoo  # tests/helpers/zoo.py: see benchmarks/__init__.py

        _, _, fields = zoo.TRANSFORMERS["gpt2"]
        config = transformers.GPT2Config(**fields)
        config._attn_implementation = zoo.ATTENTION["gpt2"]
        return transformers.GPT2LMHeadModel(config).train()
    if model == "resnet18":
        config = transformers.ResNetConfig(
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[2, 2, 2, 2],
            layer_type="basic",
            num_labels=10,
        )
        net = transformers.ResNetForImageClassification(config)
        torch.func.replace_all_batch_norm_modules_(net)
        return net.train()
    raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")


def data(cfg: UserConfig) -> dict[str, np.ndarray]:
    """The round's client data, seeded: arrays shaped [clients, steps, batch, ...].

    Images: "x" float32 [..., 3, 32, 32] standard normal, "y" int64 class labels (10 classes);
    gpt2: "ids" int64 [..., zoo.SEQ] token ids.
    """
    rng = np.random.default_rng(0)
    lead = (cfg.clients, cfg.steps, cfg.batch)
    if cfg.model == "gpt2":
        from helpers.zoo import SEQ, VOCAB

        return {"ids": rng.integers(0, VOCAB, size=(*lead, SEQ), dtype=np.int64)}
    return {
        "x": rng.standard_normal((*lead, 3, 32, 32), dtype=np.float32),
        "y": rng.integers(0, 10, size=lead, dtype=np.int64),
    }


def loss_of(model: str, call: ModelCall, batch: Mapping[str, Any]) -> Any:
    """One batch's loss in torch, the model run by `call` (the module, or a functional call)."""
    import torch.nn.functional as F

    if model == "cnn":
        return F.cross_entropy(call(batch["x"]), batch["y"])
    if model == "gpt2":
        return call(input_ids=batch["ids"], labels=batch["ids"]).loss
    return call(pixel_values=batch["x"], labels=batch["y"]).loss


def functional_loss(model: str, net: Any) -> Callable[[Any, Any], Any]:
    """The torch loss `(params, batch)` docs/algorithms.md has users write: `functional_call`."""
    import torch

    def client_loss(params: Mapping[str, Any], batch: Mapping[str, Any]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(net, dict(params), args, kwargs)

        return loss_of(model, call, batch)

    return client_loss


def _torch_data(cfg: UserConfig) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(v) for k, v in data(cfg).items()}


def local_training(model: str, net: Any, steps: int, lr: float) -> Any:
    """The documented client of `model`'s `net`: `local_training(from_torch(loss),
    optax.sgd(lr), steps)`."""
    import optax

    import bridge_mr
    from bridge_mr import algorithms as alg

    loss = bridge_mr.from_torch(functional_loss(model, net))
    return alg.local_training(loss, optax.sgd(lr), steps=steps)


def bridge_mr_round(
    net: Any, batches: Mapping[str, Any], local: Any, **options: Any
) -> Callable[[], Any]:
    """The documented round of `net` on `batches` (wherever they live): `outer_step` of
    `local`, then the server's `torch.optim.SGD(lr=1.0)` step; `options` go to `outer_step`."""
    import torch

    from bridge_mr import algorithms as alg

    params = dict(net.named_parameters())
    server_opt = torch.optim.SGD(net.parameters(), lr=1.0)

    def round_() -> Any:
        alg.outer_step(local, params, batches, **options)
        server_opt.step()
        server_opt.zero_grad()
        return list(params.values())

    return round_


def torch_loop_round(
    model: str, server: Any, batches: Mapping[str, Any], steps: int, lr: float
) -> Callable[[], Any]:
    """The plain torch loop over `server`'s clients (the leading axis of `batches`): per
    client, one local module loads the server's state, a fresh `torch.optim.SGD` takes the
    steps; the server adds the mean delta."""
    import copy

    import torch

    local = copy.deepcopy(server)
    server_params = dict(server.named_parameters())
    local_params = dict(local.named_parameters())
    clients = next(iter(batches.values())).shape[0]

    def round_() -> Any:
        total = {name: torch.zeros_like(p) for name, p in server_params.items()}
        for c in range(clients):
            local.load_state_dict(server.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=lr)
            for k in range(steps):
                opt.zero_grad()
                loss_of(model, local, {n: b[c, k] for n, b in batches.items()}).backward()
                opt.step()
            with torch.no_grad():
                for name, p in local_params.items():
                    total[name] += p - server_params[name]
        with torch.no_grad():
            for name, p in server_params.items():
                p += total[name] / clients
        return list(server_params.values())

    return round_


def torch_vmap_round(
    model: str, net: Any, batches: Mapping[str, Any], steps: int, lr: float
) -> Callable[[], Any]:
    """`torch.func.vmap` over clients of the local steps, each `torch.func.grad` of the
    `functional_call` loss."""
    from .fedavg import torch_vmap_fedavg

    server = {name: p.detach() for name, p in net.named_parameters()}
    names = tuple(batches)
    loss = functional_loss(model, net)
    return torch_vmap_fedavg(
        server,
        tuple(batches[n] for n in names),
        lambda p, batch: loss(p, dict(zip(names, batch, strict=True))),
        local_steps=steps,
        lr=lr,
    )


def build_bridge_mr(cfg: UserConfig, strategy: str | None = None) -> Callable[[], Any]:
    """The documented round (docs/algorithms.md): `from_torch` + `local_training(optax.sgd)` +
    `outer_step`, then the server's `torch.optim.SGD(lr=1.0)` step; `strategy=` passed on when
    given."""
    net = build_model(cfg.model)
    local = local_training(cfg.model, net, cfg.steps, cfg.lr)
    options = {} if strategy is None else {"strategy": strategy}
    return bridge_mr_round(net, _torch_data(cfg), local, **options)


def build_torch_loop(cfg: UserConfig) -> Callable[[], Any]:
    """The plain torch loop (`torch_loop_round`)."""
    return torch_loop_round(cfg.model, build_model(cfg.model), _torch_data(cfg), cfg.steps, cfg.lr)


def build_torch_vmap(cfg: UserConfig) -> Callable[[], Any]:
    """`torch.func.vmap` over clients (`torch_vmap_round`)."""
    return torch_vmap_round(cfg.model, build_model(cfg.model), _torch_data(cfg), cfg.steps, cfg.lr)


def build_pfl(cfg: UserConfig) -> Callable[[], Any]:
    """pfl-research's FedAvg: `FederatedAveraging` on a `SimulatedBackend`, one round per call
    (`algorithm.run` to one more central iteration), every client in each cohort, local SGD
    in batches of `cfg.batch` over the client's examples in order; evaluation off."""
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    class PflModule(torch.nn.Module):
        """The model with the `loss` and `metrics` methods pfl's PyTorchModel calls."""

        def __init__(self, net: Any, names: tuple[str, ...]) -> None:
            super().__init__()
            self.net, self.names = net, names

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.net(*args, **kwargs)

        def loss(self, *tensors: Any, eval: bool = False) -> Any:
            return loss_of(cfg.model, self.net, dict(zip(self.names, tensors, strict=True)))

        def metrics(self, *tensors: Any, eval: bool = True) -> dict[str, Any]:
            return {}

    class FedAvgNoEvaluation(FederatedAveraging):
        """FedAvg without the evaluation of every user before and after its training that pfl
        runs in evaluation rounds (the other alternatives evaluate nothing)."""

        def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
            contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

    net = build_model(cfg.model)
    batches = _torch_data(cfg)
    names = tuple(batches)
    users = {
        c: Dataset(tuple(batches[n][c].flatten(0, 1) for n in names), user_id=c)
        for c in range(cfg.clients)
    }
    federated = FederatedDataset(
        lambda user: users[user], get_user_sampler("minimize_reuse", list(range(cfg.clients)))
    )
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[])
    wrapped = PflModule(net, names)
    model = PyTorchModel(
        model=wrapped,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(wrapped.parameters(), lr=1.0),
    )
    train = NNTrainHyperParams(
        local_learning_rate=cfg.lr, local_num_epochs=1, local_batch_size=cfg.batch
    )
    algorithm = FedAvgNoEvaluation()
    done = [0]

    def pfl_round() -> Any:
        done[0] += 1
        params = NNAlgorithmParams(
            central_num_iterations=done[0],
            evaluation_frequency=1,
            train_cohort_size=cfg.clients,
            val_cohort_size=0,
        )
        algorithm.run(params, backend, model, train, send_metrics_to_platform=False)
        return list(net.parameters())

    return pfl_round


def build(alternative: str, cfg: UserConfig) -> Callable[[], Any]:
    """The round of `alternative` (one of `ALTERNATIVES`, or "bridge_mr:STRATEGY") for `cfg`."""
    if alternative.startswith("bridge_mr:"):
        return build_bridge_mr(cfg, strategy=alternative.split(":", 1)[1])
    builders: dict[str, Callable[[UserConfig], Callable[[], Any]]] = {
        "bridge_mr": build_bridge_mr,
        "torch_loop": build_torch_loop,
        "torch_vmap": build_torch_vmap,
        "pfl": build_pfl,
    }
    if alternative not in builders:
        raise ValueError(
            f"unknown alternative {alternative!r}; expected one of {ALTERNATIVES} or "
            "'bridge_mr:STRATEGY'"
        )
    return builders[alternative](cfg)
