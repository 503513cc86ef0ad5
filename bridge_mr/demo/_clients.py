"""What each client computes, as JAX functions of (server parameters, the client's data).

These are the `fn` of `bridge_mr.map_reduce(fn, server, clients)`: they see one client's slice
and know nothing about placement, torch or the number of clients.
"""

from __future__ import annotations

import jax

from ._model import Params, cross_entropy, mlp_logits

Batch = dict[str, jax.Array]


def client_loss(params: Params, batch: Batch) -> jax.Array:
    """The client's mean cross-entropy on its batch {"x": [b, 64], "y": one-hot [b, 10]}."""
    return cross_entropy(mlp_logits(params, batch["x"]), batch["y"])


def local_sgd(params: Params, batches: Batch, *, lr: float) -> dict[str, Params | jax.Array]:
    """Plain SGD from `params` over the client's batches ([steps, b, ...], one step each).

    Returns {"delta": trained - initial parameters, "loss": the mean loss over the steps}.
    """

    def step(current: Params, batch: Batch) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(client_loss)(current, batch)
        return jax.tree.map(lambda p, g: p - lr * g, current, grads), loss

    trained, losses = jax.lax.scan(step, params, batches)
    delta = jax.tree.map(lambda new, old: new - old, trained, params)
    return {"delta": delta, "loss": losses.mean()}
