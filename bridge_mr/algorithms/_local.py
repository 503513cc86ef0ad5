"""A client's local training as one JAX function: optax steps over a stack of batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeAlias

import jax
import jax.numpy as jnp
import optax

from bridge_mr.typing import PyTree

Loss: TypeAlias = Callable[[PyTree, PyTree], jax.Array]
OptimizerFactory: TypeAlias = Callable[[PyTree], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class LocalTraining:
    """A client function for `bridge_mr.map_reduce`: `steps` optimizer steps of one client.

    The steps start from the server's parameters, one per batch of the client's `[steps, ...]`
    batch stack. Made by `local_training`; read its docstring. Calling it,
    `local(server, batches)`, runs the steps (a `lax.scan`) and returns `{"delta": trained -
    server parameters, "loss": the mean loss over the steps, "first_loss": the loss of the
    first step}`. `server` is the parameter pytree, or `(params, hparams)` when the optimizer
    is a factory of `hparams`.

    Attributes:
      loss: the JAX loss `(params, batch) -> scalar`.
      optimizer: an optax `GradientTransformation`, or a function of the round's `hparams`
        returning one.
      steps: the number of local steps (the leading dimension of each client's batch stack).
      prox_mu: FedProx's coefficient `mu` of `mu / 2 * ||w - w_round||^2`; 0.0 for none.
      unroll: the steps per iteration of the `lax.scan` loop (its `unroll`); True: all.

    Example:
      >>> local = alg.local_training(jax_loss, optax.sgd(0.1), steps=2)
      >>> server = {"w": jnp.zeros(3), "b": jnp.zeros(())}  # one client's call, in JAX
      >>> out = local(server, {"x": jnp.ones((2, 4, 3)), "y": jnp.ones((2, 4))})
      >>> sorted(out), out["first_loss"]
      (['delta', 'first_loss', 'loss'], Array(1., dtype=float32))
    """

    loss: Loss
    optimizer: optax.GradientTransformation | OptimizerFactory
    steps: int
    prox_mu: float = 0.0
    unroll: int | bool = 1

    @property
    def takes_hparams(self) -> bool:
        """Whether the server value is `(params, hparams)` (the optimizer is a factory)."""
        return not isinstance(self.optimizer, optax.GradientTransformation)

    def __call__(self, server: PyTree, batches: PyTree) -> dict[str, PyTree]:
        if isinstance(self.optimizer, optax.GradientTransformation):
            params, optimizer = server, self.optimizer
        else:
            params, hparams = server
            optimizer = self.optimizer(hparams)
        check_batch_stack(batches, self.steps, "batches")
        prox_mu = self.prox_mu

        def objective(current: PyTree, batch: PyTree) -> jax.Array:
            value = self.loss(current, batch)
            if prox_mu:
                distance = sum(
                    jnp.sum(jnp.square(w - w0))
                    for w, w0 in zip(jax.tree.leaves(current), jax.tree.leaves(params), strict=True)
                )
                value = value + 0.5 * prox_mu * distance
            return value

        def step(
            carry: tuple[PyTree, optax.OptState], batch: PyTree
        ) -> tuple[tuple[PyTree, optax.OptState], jax.Array]:
            current, state = carry
            value, grads = jax.value_and_grad(objective)(current, batch)
            # optax computes e.g. Adam's bias correction as b1 ** count with an int32 count,
            # which strict dtype promotion refuses; its own code runs under standard rules.
            with jax.numpy_dtype_promotion("standard"):
                updates, state = optimizer.update(grads, state, current)
            return (optax.apply_updates(current, updates), state), value

        # A fresh inner-optimizer state every round: the server sends parameters only.
        with jax.numpy_dtype_promotion("standard"):
            state = optimizer.init(params)
        (trained, _), losses = jax.lax.scan(step, (params, state), batches, unroll=self.unroll)
        delta = jax.tree.map(jnp.subtract, trained, params)
        return {"delta": delta, "loss": jnp.mean(losses), "first_loss": losses[0]}


def local_training(
    loss: Loss,
    optimizer: optax.GradientTransformation | OptimizerFactory,
    steps: int,
    *,
    prox_mu: float = 0.0,
    unroll: int | bool = 1,
) -> LocalTraining:
    """The client side of FedAvg, FedOpt, FedProx and DiLoCo: `steps` local optimizer steps.

    Each client starts from the server's parameters with a fresh optimizer state (as
    FedAvg / DiLoCo do: inner state is not carried across rounds), takes one optax step per
    batch of its batch stack, and returns its delta (trained minus initial parameters) and its
    losses. With `prox_mu > 0` the loss each step minimizes is FedProx's
    `loss(w, batch) + prox_mu / 2 * ||w - w_round||^2` (`w_round`: the server's parameters), the
    reported losses included.

    Args:
      loss: a JAX function `(params, batch) -> scalar loss`, e.g. `bridge_mr.from_torch` of a
        torch loss.
      optimizer: the inner optimizer, an optax `GradientTransformation` (e.g.
        `optax.adamw(1e-3)`), or a function of the round's `hparams` returning one (e.g.
        `lambda lr: optax.sgd(lr)`), for hyperparameters passed as (differentiable) tensors
        with `outer_step(..., hparams=...)` / `mean_delta(..., hparams=...)`.
      steps: the number of local steps, >= 1; each client's batch stack has leading
        dimension `steps`.
      prox_mu: FedProx's proximal coefficient, >= 0 (0 disables it).
      unroll: how many steps each iteration of the steps' loop runs, as `jax.lax.scan`'s
        `unroll` (an int >= 1; True: the loop unrolled whole). The values are the same; a
        larger unroll gives XLA one program of several steps to schedule at a time (fewer
        loop iterations, and their per-iteration cost, on an accelerator) for a longer
        compile. The default, 1, keeps the loop rolled.

    Returns:
      A `LocalTraining`, the client function to give `outer_step`, `mean_delta`,
      `dp_outer_step` or `bridge_mr.map_reduce`. Make it once and reuse it (it keys the
      compiled round).

    Raises:
      TypeError: `loss` or `optimizer` is not callable / an optax transformation.
      ValueError: `steps` or `unroll` is not an int >= 1 (or a bool for `unroll`), or
        `prox_mu` is negative or not a number.

    Example:
      >>> loss = bridge_mr.from_torch(client_loss)  # client_loss: torch code
      >>> local = alg.local_training(loss, optax.adamw(1e-3), steps=20)  # DiLoCo's inner loop
      >>> local.steps, local.takes_hparams
      (20, False)
      >>> fedprox = alg.local_training(loss, lambda lr: optax.sgd(lr), steps=5, prox_mu=0.01)
      >>> fedprox.prox_mu, fedprox.takes_hparams  # hparams=lr in each round's call
      (0.01, True)
      >>> alg.local_training(loss, optax.sgd(0.1), steps=5, unroll=True).unroll  # no loop
      True
    """
    if not callable(loss):
        raise TypeError(
            f"local_training(loss=...): expected a JAX function (params, batch) -> scalar, got "
            f"{type(loss).__name__}. Fix: pass e.g. bridge_mr.from_torch(torch_loss)."
        )
    if not isinstance(optimizer, optax.GradientTransformation) and not callable(optimizer):
        raise TypeError(
            f"local_training(optimizer=...): expected an optax GradientTransformation (e.g. "
            f"optax.sgd(0.1)) or a function of hparams returning one, got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"local_training(steps=...): expected an int >= 1 (local steps per round), got "
            f"{steps!r}. Fix: e.g. steps=20."
        )
    if isinstance(prox_mu, bool) or not isinstance(prox_mu, int | float) or prox_mu < 0:
        raise ValueError(
            f"local_training(prox_mu=...): expected a number >= 0 (0 disables FedProx's "
            f"proximal term), got {prox_mu!r}."
        )
    if not isinstance(unroll, int) or (not isinstance(unroll, bool) and unroll < 1):
        raise ValueError(
            f"local_training(unroll=...): expected an int >= 1 (local steps per loop "
            f"iteration) or a bool (True: the loop unrolled whole), got {unroll!r}. Fix: e.g. "
            f"unroll={steps} or unroll=True."
        )
    return LocalTraining(loss, optimizer, steps, float(prox_mu), unroll)


def check_batch_stack(batches: PyTree, steps: int, name: str, *, axis: int = 0) -> None:
    """Raises ValueError unless every leaf of `batches` has dimension `steps` at `axis`."""
    leaves = jax.tree.leaves(batches)
    if not leaves:
        raise ValueError(f"{name}: expected a pytree of [steps, ...] arrays, got no arrays.")
    for path, leaf in jax.tree_util.tree_flatten_with_path(batches)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if len(shape) <= axis or shape[axis] != steps:
            where = jax.tree_util.keystr(path) or "the leaf"
            clients = "[clients, steps, ...]" if axis else "[steps, ...]"
            raise ValueError(
                f"{name}{where}: expected shape {clients} with steps={steps} (one batch per "
                f"local step), got shape {list(shape)}. Fix: stack {steps} batches per client, "
                f"or make local_training(..., steps={shape[axis] if len(shape) > axis else '?'})."
            )
