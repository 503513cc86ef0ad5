"""What the benchmarks run: federated rounds, per-call overhead contestants, tensor exchanges.

Everything here uses bridge_mr's public names only (`bridge_mr.map_reduce`, `torch_function`,
`jax_core`, `dlpack`), so the numbers move only when the library does. One module per family,
their names re-exported here:

* `federated`: the MLP FedSGD / FedAvg rounds (`FedConfig`, `ALTERNATIVES`);
* `rounds`: the model rounds, a CNN and a transformer LM (`RoundConfig`, `round_alternatives`);
* `overhead`: the per-call overhead contestants;
* `exchange`: the ways to move tensors between torch and JAX;
* `fedavg`: the FedAvg round each way (torch loop, `torch.func.vmap`, drjax, bridge_mr), which
  `federated`, `rounds` and the "from_torch" case build theirs from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .exchange import dlpack_paths
from .fedavg import (
    bridge_mr_fedavg,
    drjax_fedavg,
    jax_round,
    local_sgd,
    torch_fedavg_loop,
    torch_vmap_fedavg,
)
from .federated import (
    ALTERNATIVES,
    BUILDERS,
    MODELS,
    XLA_ALTERNATIVES,
    FedConfig,
    build_bridge_mr,
    build_drjax,
    build_fed,
    build_torch_loop,
    build_torch_vmap,
    client_data,
    client_update,
    jax_loss,
    jax_mlp,
    n_params,
    torch_client_data,
    torch_loss,
    torch_model,
    train_flops,
)
from .overhead import (
    autograd_floor,
    map_reduce_contestants,
    overhead_data,
    overhead_loss,
    overhead_mlp,
    torch_function_contestants,
)
from .rounds import (
    ROUND_ALTERNATIVES,
    STRATEGIES,
    RoundConfig,
    build_round,
    build_round_bridge_mr,
    build_round_drjax,
    build_round_torch_loop,
    build_round_torch_vmap,
    build_round_xla_per_client,
    jax_cnn,
    jax_lm,
    map_reduce_strategies,
    round_alternatives,
    round_client_update,
    round_config,
    round_data,
    round_jax_loss,
    round_jax_state,
    round_torch_loss,
    round_torch_model,
)


def build(alternative: str, cfg: FedConfig | RoundConfig) -> Callable[[], Any] | str:
    """The round of `alternative` for `cfg`, or why it cannot be built here (a string).

    A `FedConfig` goes to `build_fed`, a `RoundConfig` (a model round) to `build_round`.
    """
    if isinstance(cfg, RoundConfig):
        return build_round(alternative, cfg)
    return build_fed(alternative, cfg)


__all__ = [
    "ALTERNATIVES",
    "BUILDERS",
    "MODELS",
    "ROUND_ALTERNATIVES",
    "STRATEGIES",
    "XLA_ALTERNATIVES",
    "FedConfig",
    "RoundConfig",
    "autograd_floor",
    "bridge_mr_fedavg",
    "build",
    "build_bridge_mr",
    "build_drjax",
    "build_fed",
    "build_round",
    "build_round_bridge_mr",
    "build_round_drjax",
    "build_round_torch_loop",
    "build_round_torch_vmap",
    "build_round_xla_per_client",
    "build_torch_loop",
    "build_torch_vmap",
    "client_data",
    "client_update",
    "dlpack_paths",
    "drjax_fedavg",
    "jax_cnn",
    "jax_lm",
    "jax_loss",
    "jax_mlp",
    "jax_round",
    "local_sgd",
    "map_reduce_contestants",
    "map_reduce_strategies",
    "n_params",
    "overhead_data",
    "overhead_loss",
    "overhead_mlp",
    "round_alternatives",
    "round_client_update",
    "round_config",
    "round_data",
    "round_jax_loss",
    "round_jax_state",
    "round_torch_loss",
    "round_torch_model",
    "torch_client_data",
    "torch_fedavg_loop",
    "torch_function_contestants",
    "torch_loss",
    "torch_model",
    "torch_vmap_fedavg",
    "train_flops",
]
