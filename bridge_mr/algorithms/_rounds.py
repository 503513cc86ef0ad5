"""One round of FedAvg / FedOpt / DiLoCo on torch parameters: the mean delta and the outer step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import torch
from jax.sharding import AbstractMesh, Mesh
from typing_extensions import TypedDict, Unpack

from bridge_mr.torch_api import map_reduce
from bridge_mr.typing import AutoOrStrategy, PyTree

from ._local import LocalTraining, check_batch_stack

Params: TypeAlias = Mapping[str, torch.Tensor]


def mean_delta(
    local: LocalTraining,
    params: Params,
    client_batches: PyTree,
    *,
    hparams: PyTree | None = None,
    weights: torch.Tensor | None = None,
    strategy: AutoOrStrategy = "auto",
    chunk_size: int | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The clients' (weighted) mean delta of one round, differentiable, by `bridge_mr.map_reduce`.

    Every client runs `local` from `params` on its batch stack; the deltas and losses are
    averaged, weighted by `weights` (e.g. example counts; zero for padding) when given. The
    result is an ordinary torch value: gradients reach `params`, `hparams` and the batches
    (e.g. a client learning rate: hypergradients through the whole round).

    Args:
      local: the client function, from `local_training`.
      params: the server's parameters, e.g. `dict(model.named_parameters())`.
      client_batches: a pytree of tensors shaped `[clients, steps, ...]`.
      hparams: the value `local`'s optimizer factory takes (tensors, numbers or a pytree of
        them); required exactly when `local` was made with a factory.
      weights: one weight per client (shape `[clients]`), or None for the plain mean.
      strategy: `bridge_mr.map_reduce`'s strategy ("auto", "vmap", "per_client", "chunks").
      chunk_size: for strategy="chunks": clients per chunk.
      mesh: the mesh whose "clients" axis the clients are sharded over (see `map_reduce`).

    Returns:
      `(delta, metrics)`: the mean delta, keyed like `params`, and `{"loss": mean local loss,
      "first_loss": mean loss of the first local step (the server model's)}`.

    Raises:
      TypeError: `local` is not a `LocalTraining`, `params` not a mapping of tensors.
      ValueError: a batch leaf's second dimension is not `local.steps`; `hparams` given to
        (or missing for) `local`; and what `bridge_mr.map_reduce` raises.

    Example:
      With `strategy="vmap"` (no one-time measurement of the strategies, as "auto" makes):

      >>> delta, metrics = alg.mean_delta(local, params, batches, strategy="vmap")
      >>> delta["w"].shape, metrics["first_loss"]
      (torch.Size([3]), tensor(1., grad_fn=<...>))
      >>> tuned = alg.local_training(jax_loss, lambda lr: optax.sgd(lr), steps=2)
      >>> lr = torch.tensor(0.1, requires_grad=True)
      >>> delta, _ = alg.mean_delta(tuned, params, batches, hparams=lr, strategy="vmap")
      >>> delta["b"].backward()  # a hypergradient, through the whole round
      >>> bool(lr.grad > 0)  # a larger client learning rate moves b further towards 1
      True
    """
    result = _run_round(
        local,
        params,
        client_batches,
        pseudo_gradient=False,
        hparams=hparams,
        weights=weights,
        strategy=strategy,
        chunk_size=chunk_size,
        mesh=mesh,
    )
    delta = result.pop("delta")
    return delta, result


@dataclasses.dataclass(frozen=True)
class _PseudoGradient:
    """`local`'s result with minus its delta, as "pseudo_gradient": `outer_step`'s client, so
    that the negation is part of the round's program. Keyed by its field, as `local` is: the
    one made at each call reuses the round's program."""

    local: LocalTraining

    def __call__(self, server: PyTree, batches: PyTree) -> dict[str, PyTree]:
        out = self.local(server, batches)
        minus = jax.tree.map(jnp.negative, out.pop("delta"))
        return {"pseudo_gradient": minus, **out}


def _run_round(
    local: LocalTraining,
    params: Params,
    client_batches: PyTree,
    pseudo_gradient: bool,
    **options: Unpack[RoundOptions],
) -> dict[str, Any]:
    """`map_reduce` of `local` (its "delta"; minus that, "pseudo_gradient", if
    `pseudo_gradient`) over the round's clients, `options` as `mean_delta` takes them."""
    server = round_server(local, params, client_batches, options.get("hparams"), "mean_delta")
    weights = options.get("weights")
    return map_reduce(
        _PseudoGradient(local) if pseudo_gradient else local,
        server,
        client_batches,
        reduce="mean" if weights is None else "weighted_mean",
        weights=weights,
        **_given(options, "mesh", "strategy", "chunk_size"),
    )


def _given(options: RoundOptions, *names: str) -> dict[str, Any]:
    """Those of `names` the caller gave: `map_reduce`'s own defaults hold for the others."""
    given: dict[str, Any] = dict(options)
    return {name: given[name] for name in names if name in given}


class RoundOptions(TypedDict, total=False):
    """`mean_delta`'s keyword arguments, which `outer_step` passes on (see `mean_delta`)."""

    hparams: PyTree | None
    weights: torch.Tensor | None
    strategy: AutoOrStrategy
    chunk_size: int | None
    mesh: Mesh | AbstractMesh | None


def outer_step(
    local: LocalTraining, params: Params, client_batches: PyTree, **options: Unpack[RoundOptions]
) -> dict[str, torch.Tensor]:
    """Runs one round's clients and sets each parameter's `.grad` to minus the mean delta.

    That is the outer pseudo-gradient: a following `server_opt.step()` of any `torch.optim`
    optimizer over `params` is the server update (SGD(lr=1): FedAvg; SGD with momentum:
    FedAvgM; Adam: FedAdam; `Yogi`: FedYogi; SGD(nesterov=True) after AdamW inner steps:
    DiLoCo). `.grad` is replaced, not accumulated; nothing is differentiated (use `mean_delta`
    to differentiate through a round).

    Args:
      local, params, client_batches: as for `mean_delta`.
      options: `mean_delta`'s keyword arguments (hparams, weights, strategy, chunk_size,
        mesh), with its defaults.

    Returns:
      The round's metrics, `{"loss": ..., "first_loss": ...}` (0-d torch tensors).

    Raises:
      As `mean_delta`.

    Example:
      >>> server_opt = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
      >>> metrics = alg.outer_step(local, params, batches)  # e.g. model.named_parameters()
      >>> metrics["first_loss"]  # the server model's loss
      tensor(1.)
      >>> bool(params["b"].grad < 0)  # minus the mean delta: the clients raised b
      True
      >>> server_opt.step()
      >>> server_opt.zero_grad()
    """
    with torch.no_grad():
        # Minus the delta inside the round's program: as one torch op per parameter, the
        # negations took 7.3 ms of a GPT-2 round on TorchTPU (28 parameters; docs/tpu.md).
        result = _run_round(local, params, client_batches, pseudo_gradient=True, **options)
        set_pseudo_gradient(params, result.pop("pseudo_gradient"))
    return result


def set_pseudo_gradient(params: Params, pseudo_gradient: Mapping[str, torch.Tensor]) -> None:
    """Sets `params[k].grad = pseudo_gradient[k]` (minus the update) for every key (detached,
    in the parameter's dtype and device)."""
    for name, p in params.items():
        p.grad = pseudo_gradient[name].detach().to(dtype=p.dtype, device=p.device)


def round_server(
    local: Any, params: Any, client_batches: PyTree, hparams: PyTree | None, caller: str
) -> PyTree:
    """The server value `local` takes, after checking the arguments."""
    if not isinstance(local, LocalTraining):
        raise TypeError(
            f"{caller}(local=...): expected the client function from "
            f"bridge_mr.algorithms.local_training(...), got {type(local).__name__}."
        )
    if not isinstance(params, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()
    ):
        raise TypeError(
            f"{caller}(params=...): expected a mapping from names to torch tensors, e.g. "
            f"dict(model.named_parameters()), got {type(params).__name__}."
        )
    check_batch_stack(client_batches, local.steps, f"{caller}(client_batches=...)", axis=1)
    if local.takes_hparams and hparams is None:
        raise ValueError(
            f"{caller}(hparams=...): local's optimizer is a factory of hparams, so hparams is "
            "required (e.g. hparams=torch.tensor(0.1) for lambda lr: optax.sgd(lr)); got None."
        )
    if not local.takes_hparams and hparams is not None:
        raise ValueError(
            f"{caller}(hparams=...): local's optimizer is a fixed optax transformation, which "
            "takes no hparams; got some. Fix: drop hparams, or make local_training's optimizer "
            "a function of them (e.g. lambda lr: optax.sgd(lr))."
        )
    params = dict(params)
    return (params, hparams) if local.takes_hparams else params
