"""`bridge_mr.from_torch`: a converted loss as a plain JAX function (eager, `jax.jit`,
`jax.grad`, `jax.vmap`) against torch autograd, and a BatchNorm in eval mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import zoo
from helpers.from_torch import close, state_of

import bridge_mr

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["cnn_groupnorm", "gru", "transformer"])
def test_value_and_grad_match_torch_autograd(name: str, jit: bool) -> None:
    model = zoo.tiny(name)
    data = zoo.tiny_data(name, 6)
    converted = bridge_mr.from_torch(zoo.tiny_loss(model))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    x, y = jnp.asarray(data["x"].numpy()), jnp.asarray(data["y"].numpy().astype(np.int32))
    value_and_grad = jax.value_and_grad(converted)
    loss, grads = (jax.jit(value_and_grad) if jit else value_and_grad)(params, x, y)
    expected = F.cross_entropy(model(data["x"]), data["y"])
    expected.backward()
    close(loss, expected, "loss")
    for k, p in model.named_parameters():
        close(grads[k], p.grad, k)


def test_vmap_over_clients_matches_per_client_calls() -> None:
    model = zoo.tiny("lstm")
    data = zoo.tiny_data("lstm", 3, 4)
    converted = bridge_mr.from_torch(zoo.tiny_loss(model))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    x, y = jnp.asarray(data["x"].numpy()), jnp.asarray(data["y"].numpy().astype(np.int32))
    batched = jax.vmap(converted, in_axes=(None, 0, 0))(params, x, y)
    for c in range(3):
        close(batched[c], F.cross_entropy(model(data["x"][c]), data["y"][c]), f"client {c}")


def test_batchnorm_eval_mode_uses_the_running_statistics_unchanged() -> None:
    model = zoo.tiny("cnn_batchnorm")
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    x = zoo.tiny_data("cnn_batchnorm", 4)["x"]
    converted = bridge_mr.from_torch(
        lambda s, x: torch.func.functional_call(model, s, (x,)), mutable=0
    )
    state = {k: jnp.asarray(v.detach().numpy()) for k, v in state_of(model).items()}
    out, after = converted(state, jnp.asarray(x.numpy()))
    close(out, model(x), "eval output")
    for k in state:
        assert after[k] is state[k], f"{k} changed in eval mode"
