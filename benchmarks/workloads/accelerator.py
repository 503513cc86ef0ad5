"""The "accelerator" case's rounds (issues 31, 41): the documented FedAvg round and the tiny
call, on the device a user's tensors live on ("cpu" or "cuda"), or with host tensors on a TPU
host ("tpu": the tensors on the CPU, JAX's programs on the chip), and what they would write
instead, at torch's float32 matmul precision `precision` ("highest" or "medium").

Rows (`AcceleratorConfig.model`):

* "cnn": pfl-research's CIFAR10 simple_cnn FedAvg round (`workloads.users`, "cnn").
* "gpt2_128": transformers' GPT-2 at 2 layers of width 128 (4 heads), sequences of
  `GPT2_128_SEQ` tokens, its own `labels=` loss (the zoo's GPT-2 config, widened).
* "tiny": one tiny `map_reduce` forward + backward (the "overhead" case's MLP: `clients`
  clients, width `WIDTH`, `batch` examples each): the per-call cost, no local steps.

Alternatives (`ALTERNATIVES`), each a zero-argument call returning what it computed (the server
parameters after the round; the tiny call's gradients), its tensors created on the device:

* "torch_loop": a plain torch loop over clients (and local steps, `torch.optim.SGD`); on a TPU
  host, on the host CPU.
* "torch_vmap": `torch.func.vmap` over clients of the local steps (tiny: of the client loss,
  then `.mean().backward()`).
* "bridge_mr": the documented path, `strategy="auto"`; "bridge_mr:NAME" forces a strategy,
  "bridge_mr:chunks:16" chunks of 16 clients.
* "torch_loop_torchtpu", "bridge_mr_torchtpu[:NAME]": the same on TorchTPU's "tpu" tensors
  (`torch_tpu`, in a process where JAX stays on the CPU: `JAX_PLATFORMS=cpu`): the torch loop
  run by TorchTPU, and bridge_mr's programs run on the chip by TorchTPU.
* "pure_jax": the floor, `jax.jit(jax.vmap(...))` over clients of the same converted client
  (`from_torch` + `local_training`), the mean delta and the server step (tiny: `jax.jit` of
  `jax.value_and_grad` of the same `jax_core` program), on the JAX device of the same kind
  (TPU: the chip), under `jax.default_matmul_precision` of the row's precision.

`flops` counts a row's floating-point work once, from the vmap program's jaxpr
(`bridge_mr.auto.cost`: matrix products and convolutions, loop bodies once per iteration);
`device_peak` is the FLOP/s the achieved rates are compared with.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import users

#: The rows' models, in the order the case measures them.
MODELS = ("tiny", "gpt2_128", "cnn")
#: The alternatives measured by default.
ALTERNATIVES = (
    "torch_loop",
    "torch_vmap",
    "bridge_mr",
    "bridge_mr_resident",
    "bridge_mr:vmap",
    "bridge_mr:per_client",
    "bridge_mr:chunks:16",
    "pure_jax",
)
#: The alternatives on TorchTPU's "tpu" tensors, measured when named (they need torch_tpu).
TORCH_TPU_ALTERNATIVES = ("torch_loop_torchtpu", "bridge_mr_torchtpu")
#: GPT-2 "gpt2_128": the zoo's config fields replaced, and its sequence length.
GPT2_128 = {"n_embd": 128, "n_positions": 64}
GPT2_128_SEQ = 32
#: The tiny call's MLP width (the "overhead" case's "map_reduce fedsgd tiny" row).
WIDTH = 8

#: Peak FLOP/s of GPUs by the name torch reports, from NVIDIA's datasheets (dense: the
#: datasheets' Tensor Core figures are with 2:4 sparsity, twice the dense rate). "tf32": TF32
#: Tensor Core (what cuDNN's convolutions and XLA's float32 dots use by default on these GPUs);
#: "fp32": non-tensor FP32. The first key contained in the device's name is used.
GPU_PEAKS: dict[str, dict[str, Any]] = {
    "H200 NVL": {
        "tf32": 417.5e12,
        "fp32": 60e12,
        "source": "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): H200 NVL TF32 "
        "Tensor Core 835 TFLOPS with sparsity, FP32 60 TFLOPS",
    },
    "H200": {
        "tf32": 494.7e12,
        "fp32": 66.9e12,
        "source": "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): H200 SXM TF32 "
        "Tensor Core 989 TFLOPS with sparsity, FP32 67 TFLOPS (66.9 = 16,896 cores x 2 x "
        "1.98 GHz boost)",
    },
    "H100 80GB HBM3": {
        "tf32": 494.7e12,
        "fp32": 66.9e12,
        "source": "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): H100 SXM TF32 "
        "Tensor Core 989 TFLOPS with sparsity, FP32 67 TFLOPS",
    },
    "A100": {
        "tf32": 156e12,
        "fp32": 19.5e12,
        "source": "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): TF32 Tensor Core "
        "156 TFLOPS (312 with sparsity), FP32 19.5 TFLOPS",
    },
}
#: Peak FLOP/s of TPUs by JAX's `device_kind`, from Google's datasheets: the MXU's bf16 rate
#: (a float32 matmul at precision "highest" takes 6 bf16 passes, "high" 3, "medium" one).
TPU_PEAKS: dict[str, dict[str, Any]] = {
    "TPU v5 lite": {
        "bf16": 197e12,
        "source": "Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): 197 "
        "TFLOP/s bf16 per chip",
    },
}
#: The CPU reference: a float32 matmul of this size, timed in the counting process.
CPU_MATMUL_N = 2048
#: JAX's matmul precision for torch's float32 matmul precision (what bridge_mr applies).
JAX_PRECISION = {"highest": "highest", "high": "high", "medium": "default"}


@dataclasses.dataclass(frozen=True)
class AcceleratorConfig:
    """One row.

    Attributes:
      model: one of `MODELS`.
      clients: clients in the round (the tiny call: in the call).
      steps: local SGD steps per client (the tiny call: 1, unused).
      batch: examples per step.
      device: "cpu" or "cuda": where the tensors are created; "tpu": tensors on the CPU of a
        TPU host, JAX's programs on the chip.
      lr: the clients' SGD learning rate.
      precision: `torch.set_float32_matmul_precision`'s value in every alternative's process
        ("highest", "high" or "medium"); pure JAX gets the same (`JAX_PRECISION`).
    """

    model: str
    clients: int
    steps: int = 5
    batch: int = 10
    device: str = "cpu"
    lr: float = 0.05
    precision: str = "highest"

    @property
    def row_id(self) -> str:
        """The row's name in result tables: "accelerator/<model>/c<clients>[/<precision>]"
        (the precision where it is not "highest")."""
        suffix = "" if self.precision == "highest" else f"/{self.precision}"
        return f"accelerator/{self.model}/c{self.clients}{suffix}"

    @property
    def tensor_device(self) -> str:
        """Where the torch tensors live: the host CPU on a TPU host."""
        return "cpu" if self.device == "tpu" else self.device

    def users(self) -> users.UserConfig:
        """The same round as `workloads.users` names it (its "cnn" data and model)."""
        return users.UserConfig("cnn", self.clients, self.steps, self.batch, self.lr)


def build_model(model: str) -> Any:
    """The torch module of a round row, seeded, in training mode, on the CPU."""
    if model != "gpt2_128":
        return users.build_model(model)
    import torch
    import transformers
    from helpers import zoo  # tests/helpers/zoo.py: see benchmarks/__init__.py

    torch.manual_seed(0)
    _, _, fields = zoo.TRANSFORMERS["gpt2"]
    config = transformers.GPT2Config(**{**fields, **GPT2_128})
    config._attn_implementation = zoo.ATTENTION["gpt2"]
    return transformers.GPT2LMHeadModel(config).train()


def data(cfg: AcceleratorConfig) -> dict[str, np.ndarray]:
    """A round row's client data, seeded, [clients, steps, batch, ...] (`users.data`'s)."""
    if cfg.model != "gpt2_128":
        return users.data(cfg.users())
    from helpers.zoo import VOCAB

    rng = np.random.default_rng(0)
    shape = (cfg.clients, cfg.steps, cfg.batch, GPT2_128_SEQ)
    return {"ids": rng.integers(0, VOCAB, size=shape, dtype=np.int64)}


def _family(model: str) -> str:
    return "gpt2" if model == "gpt2_128" else model


def _torch_data(cfg: AcceleratorConfig, device: str | None = None) -> dict[str, Any]:
    import torch

    on = device or cfg.tensor_device
    return {k: torch.from_numpy(v).to(on) for k, v in data(cfg).items()}


def _jax_device(device: str) -> Any:
    import jax

    return jax.devices(device if device in ("cuda", "tpu") else "cpu")[0]


def _jax_tree(tree: Mapping[str, np.ndarray], device: str) -> dict[str, Any]:
    """numpy arrays on the JAX device (int64 as int32: JAX's default integer width)."""
    import jax

    on = _jax_device(device)
    return {
        k: jax.device_put(v.astype(np.int32) if v.dtype == np.int64 else v, on)
        for k, v in tree.items()
    }


def _local(cfg: AcceleratorConfig, net: Any) -> Any:
    """The documented client (`users.local_training`)."""
    return users.local_training(_family(cfg.model), net, cfg.steps, cfg.lr)


def _resident(alternative: str) -> bool:
    """Whether `alternative` holds the client data as JAX arrays where the program runs (data
    on the chip, as `bridge_mr.data.FederatedDataset.to(jax_device)` does): "bridge_mr_resident"."""
    return alternative.split(":")[0] == "bridge_mr_resident"


def on_torch_tpu(alternative: str) -> bool:
    """Whether `alternative`'s tensors are TorchTPU's ("tpu"): "..._torchtpu[:STRATEGY]"."""
    return alternative.split(":")[0].endswith("_torchtpu")


def _tensor_device(cfg: AcceleratorConfig, alternative: str) -> str:
    return "tpu" if on_torch_tpu(alternative) else cfg.tensor_device


def _strategy(alternative: str) -> dict[str, Any]:
    """ "bridge_mr[_resident|_torchtpu][:STRATEGY[:CHUNK]]" -> map_reduce's keyword arguments."""
    parts = alternative.split(":")
    options: dict[str, Any] = {}
    if len(parts) > 1:
        options["strategy"] = parts[1]
    if len(parts) > 2:
        options["chunk_size"] = int(parts[2])
    return options


# The round rows.


def round_bridge_mr(cfg: AcceleratorConfig, alternative: str) -> Callable[[], Any]:
    """The documented round on the device (`users.bridge_mr_round`)."""
    device = _tensor_device(cfg, alternative)
    net = build_model(cfg.model).to(device)
    local = _local(cfg, net)
    if _resident(alternative):
        batches = _jax_tree(data(cfg), cfg.device)
    else:
        batches = _torch_data(cfg, device)
    return users.bridge_mr_round(net, batches, local, **_strategy(alternative))


def round_torch_loop(cfg: AcceleratorConfig, alternative: str) -> Callable[[], Any]:
    """A plain torch loop on the device (`users.torch_loop_round`)."""
    device = _tensor_device(cfg, alternative)
    server = build_model(cfg.model).to(device)
    batches = _torch_data(cfg, device)
    return users.torch_loop_round(_family(cfg.model), server, batches, cfg.steps, cfg.lr)


def round_torch_vmap(cfg: AcceleratorConfig) -> Callable[[], Any]:
    """`torch.func.vmap` over clients on the device (`users.torch_vmap_round`)."""
    net = build_model(cfg.model).to(cfg.tensor_device)
    return users.torch_vmap_round(_family(cfg.model), net, _torch_data(cfg), cfg.steps, cfg.lr)


def _round_program(cfg: AcceleratorConfig) -> tuple[Callable[..., Any], Any, Any, list[str]]:
    """The pure-JAX round (params, batches) -> params, its numpy arguments, parameter names."""
    import jax
    import jax.numpy as jnp

    net = build_model(cfg.model)
    local = _local(cfg, net)
    names = [name for name, _ in net.named_parameters()]
    params = {name: p.detach().numpy() for name, p in net.named_parameters()}

    def program(server: Any, batches: Any) -> Any:
        deltas = jax.vmap(local, in_axes=(None, 0))(server, batches)["delta"]
        return jax.tree.map(lambda p, d: p + jnp.mean(d, axis=0), server, deltas)

    return program, params, data(cfg), names


def round_pure_jax(cfg: AcceleratorConfig) -> Callable[[], Any]:
    """The floor: `jax.jit` of the vmapped converted client, the mean delta, the server step."""
    import jax

    program, params, batches, names = _round_program(cfg)
    step = jax.jit(program)
    state = [_jax_tree(params, cfg.device)]
    on_device = _jax_tree(batches, cfg.device)

    def pure_jax_round() -> Any:
        with jax.default_matmul_precision(JAX_PRECISION[cfg.precision]):
            state[0] = step(state[0], on_device)
        return [state[0][name] for name in names]

    return pure_jax_round


# The tiny call.


def _tiny_numpy(cfg: AcceleratorConfig) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    from .overhead import overhead_data

    return overhead_data(cfg.clients, WIDTH, cfg.batch)


def _tiny_program(cfg: AcceleratorConfig) -> Callable[[Any, Any], Any]:
    """The tiny call as a `jax_core` program (the "overhead" case's pure-JAX contestant)."""
    from bridge_mr import jax_core

    from .overhead import overhead_loss

    def program(params: Any, data: Any) -> Any:
        with jax_core.program(placements={"clients": cfg.clients}):
            placed = jax_core.broadcast(params)
            return jax_core.reduce_mean(jax_core.map_fn(overhead_loss, (placed, data)))

    return program


def tiny_call(cfg: AcceleratorConfig, alternative: str) -> Callable[[], Any]:
    """The tiny `map_reduce` forward + backward (mean client loss, its gradients), one way."""
    import torch

    from .overhead import overhead_loss

    params_np, data_np = _tiny_numpy(cfg)
    order = list(params_np)
    if alternative == "pure_jax":
        import jax

        value_and_grad = jax.jit(jax.value_and_grad(_tiny_program(cfg)))
        j_params, j_data = _jax_tree(params_np, cfg.device), _jax_tree(data_np, cfg.device)

        def pure_jax() -> Any:
            with jax.default_matmul_precision(JAX_PRECISION[cfg.precision]):
                _, grads = value_and_grad(j_params, j_data)
            return [grads[k] for k in order]

        return pure_jax
    t_params = {
        k: torch.tensor(v, device=cfg.tensor_device, requires_grad=True)
        for k, v in params_np.items()
    }
    t_data = {k: torch.tensor(v, device=cfg.tensor_device) for k, v in data_np.items()}

    def mlp_loss(p: Mapping[str, Any], x: Any, y: Any) -> Any:
        hidden = torch.tanh(x @ p["w1"] + p["b1"])
        return ((hidden @ p["w2"] + p["b2"] - y) ** 2).mean()

    def grads() -> list[Any]:
        return [t_params[k].grad for k in order]

    def clear() -> None:
        for p in t_params.values():
            p.grad = None

    if alternative.startswith("bridge_mr"):
        import bridge_mr

        options = _strategy(alternative)
        clients = _jax_tree(data_np, cfg.device) if _resident(alternative) else t_data

        def bridge() -> Any:
            clear()
            bridge_mr.map_reduce(overhead_loss, t_params, clients, **options).backward()
            return grads()

        return bridge
    if alternative == "torch_loop":
        xs, ys = t_data["x"].unbind(0), t_data["y"].unbind(0)

        def torch_loop() -> Any:
            clear()
            total = sum(mlp_loss(t_params, x, y) for x, y in zip(xs, ys, strict=True))
            (total / cfg.clients).backward()
            return grads()

        return torch_loop
    if alternative == "torch_vmap":
        per_client = torch.func.vmap(mlp_loss, in_dims=(None, 0, 0))

        def torch_vmap() -> Any:
            clear()
            per_client(t_params, t_data["x"], t_data["y"]).mean().backward()
            return grads()

        return torch_vmap
    raise ValueError(f"unknown alternative {alternative!r}; expected one of {ALTERNATIVES}")


def build(alternative: str, cfg: AcceleratorConfig) -> Callable[[], Any]:
    """The call of `alternative` (one of `ALTERNATIVES`, or "bridge_mr:STRATEGY[:CHUNK]")."""
    if cfg.model == "tiny":
        return tiny_call(cfg, alternative)
    if alternative.startswith("bridge_mr"):
        return round_bridge_mr(cfg, alternative)
    if alternative in ("torch_loop", "torch_loop_torchtpu"):
        return round_torch_loop(cfg, alternative)
    builders: dict[str, Callable[[AcceleratorConfig], Callable[[], Any]]] = {
        "torch_vmap": round_torch_vmap,
        "pure_jax": round_pure_jax,
    }
    if alternative not in builders:
        known = (*ALTERNATIVES, *TORCH_TPU_ALTERNATIVES)
        raise ValueError(f"unknown alternative {alternative!r}; expected one of {known}")
    return builders[alternative](cfg)


# FLOPs and the device's peak.


def flops(cfg: AcceleratorConfig) -> float:
    """Floating-point operations of one call, counted once from the vmap program's jaxpr
    (`bridge_mr.auto.cost`; traced with abstract arguments, nothing runs)."""
    import jax

    from bridge_mr.auto import cost

    def spec(tree: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {
            k: jax.ShapeDtypeStruct(v.shape, np.int32 if v.dtype == np.int64 else v.dtype)
            for k, v in tree.items()
        }

    if cfg.model == "tiny":
        params, batches = _tiny_numpy(cfg)
        fn: Callable[..., Any] = jax.value_and_grad(_tiny_program(cfg))
    else:
        fn, params, batches, _ = _round_program(cfg)
    return float(cost(jax.make_jaxpr(fn)(spec(params), spec(batches))).flops)


def device_peak(device: str) -> dict[str, Any]:
    """The FLOP/s achieved rates are compared with: {"name", "peak_flop_per_s", "source"}
    (CUDA: "fp32_flop_per_s" too; an unknown GPU or TPU: no peak, the source says why).

    CUDA: `gpu_peak` of the device's name, its dense TF32 Tensor Core rate. TPU: `TPU_PEAKS`
    of JAX's first device's kind, its bf16 rate. CPU: a float32 torch matmul of
    `CPU_MATMUL_N`, best of 10 after a warm-up, measured here (this process).
    """
    import torch

    if device == "cuda":
        return gpu_peak(torch.cuda.get_device_name(0))
    if device == "tpu":
        import jax

        return tpu_peak(jax.devices("tpu")[0].device_kind)
    n = CPU_MATMUL_N
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(10))
    return {
        "name": "cpu",
        "peak_flop_per_s": 2 * n**3 / best,
        "source": f"measured: float32 torch.mm {n}x{n}, best of 10, {torch.get_num_threads()} "
        "threads, in the counting process",
    }


def gpu_peak(name: str) -> dict[str, Any]:
    """`device_peak` of the GPU torch names `name`, from `GPU_PEAKS` (the first key it
    contains); without a peak (the source says why) when none matches."""
    for key, peak in GPU_PEAKS.items():
        if key in name:
            return {
                "name": name,
                "peak_flop_per_s": peak["tf32"],
                "fp32_flop_per_s": peak["fp32"],
                "source": f"{peak['source']}; the peak: dense TF32 Tensor Core",
            }
    return {"name": name, "source": f"no datasheet peak for {name!r} in GPU_PEAKS"}


def tpu_peak(kind: str) -> dict[str, Any]:
    """`device_peak` of the TPU JAX calls `kind`, from `TPU_PEAKS` (its bf16 rate); without a
    peak (the source says why) for a kind not there."""
    if kind not in TPU_PEAKS:
        return {"name": kind, "source": f"no datasheet peak for {kind!r} in TPU_PEAKS"}
    peak = TPU_PEAKS[kind]
    return {"name": kind, "peak_flop_per_s": peak["bf16"], "source": peak["source"]}


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
