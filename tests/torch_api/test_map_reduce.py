"""map_reduce: gradients for each reduction, torch references, nn.Module training, long loops."""

from __future__ import annotations

import gc
import re
import resource
import threading

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.clients import client_loss, torch_client_loss
from helpers.precision import precisions
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import bridge_mr
from bridge_mr import dlpack, jax_core
from bridge_mr.torch_api import broadcast, map_reduce

F64 = torch.float64


def _case(n, width=2, batch=3, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(width, width, dtype=dtype, generator=gen),
        "b": torch.randn(width, dtype=dtype, generator=gen),
    }
    clients = {
        "x": torch.randn(n, batch, width, dtype=dtype, generator=gen),
        "y": torch.randn(n, batch, dtype=dtype, generator=gen),
    }
    weights = torch.rand(n, dtype=dtype, generator=gen) + 0.5
    return params, clients, weights


def _torch_reference(params, clients, weights, reduce):
    losses = torch.stack(
        [torch_client_loss(params, x, y) for x, y in zip(clients["x"], clients["y"], strict=True)]
    )
    if reduce == "sum":
        return losses.sum()
    if reduce == "mean":
        return losses.mean()
    return (losses * weights).sum() / weights.sum()


@pytest.mark.x64
@pytest.mark.parametrize("reduce", ["mean", "sum", "weighted_mean"])
def test_gradcheck_and_gradgradcheck_wrt_server_clients_and_weights(reduce):
    params, clients, weights = _case(2, width=2, batch=2, dtype=F64)
    w_weights = weights.requires_grad_() if reduce == "weighted_mean" else None

    def f(w, b, x, *maybe_weights):
        return map_reduce(
            client_loss,
            {"w": w, "b": b},
            {"x": x, "y": clients["y"]},
            reduce=reduce,
            weights=maybe_weights[0] if maybe_weights else None,
        )

    inputs = (
        params["w"].requires_grad_(),
        params["b"].requires_grad_(),
        clients["x"].requires_grad_(),
        *([w_weights] if w_weights is not None else []),
    )
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize(
    ("dtype", "tolerances"), precisions(float64=(1e-12, 1e-10), float32=(1e-5, 1e-4))
)
@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 5),
    width=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    reduce=st.sampled_from(["mean", "sum", "weighted_mean"]),
)
def test_equals_a_pure_torch_loop(dtype, tolerances, n, width, seed, reduce):
    rtol, grad_rtol = tolerances  # Of the values, of the gradients.
    params, clients, weights = _case(n, width=width, seed=seed, dtype=dtype)
    for p in params.values():
        p.requires_grad_()
    got = map_reduce(
        client_loss,
        params,
        clients,
        reduce=reduce,
        weights=weights if reduce == "weighted_mean" else None,
    )
    got_grads = torch.autograd.grad(got, list(params.values()))
    want = _torch_reference(params, clients, weights, reduce)
    want_grads = torch.autograd.grad(want, list(params.values()))
    assert_trees_all_close(got, want, rtol=rtol, atol=rtol)
    assert_trees_all_close(list(got_grads), list(want_grads), rtol=grad_rtol, atol=rtol)


def test_pytree_outputs_and_jax_fallthrough():
    params, clients, _ = _case(4)

    def stats(p, batch):
        return {"loss": client_loss(p, batch), "count": jnp.asarray(batch["y"].shape[0])}

    out = map_reduce(stats, params, clients, reduce="sum")
    assert_trees_all_close(out["count"], torch.tensor(12))
    as_jax = jax.tree.map(lambda t: jnp.asarray(t.numpy()), (params, clients))
    jax_out = map_reduce(stats, *as_jax, reduce="sum")
    assert isinstance(jax_out["loss"], jax.Array)
    assert_trees_all_close(jax_out, out)


def _cross_entropy(params, batch):
    """A classifier's loss whose labels index (take_along_axis) and one-hot encode."""
    logits = batch["x"] @ params["w"] + params["b"]
    log_p = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(log_p, batch["y"][:, None], axis=1)[:, 0]
    one_hot = jax.nn.one_hot(batch["y"], logits.shape[-1], dtype=logits.dtype)
    smooth = jnp.sum(one_hot * logits, axis=-1)
    return -jnp.mean(picked) + 0.1 * jnp.mean(smooth)


def _classification(n=4, batch=6, features=3, classes=5):
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(features, classes, generator=gen, requires_grad=True),
        "b": torch.randn(classes, generator=gen, requires_grad=True),
    }
    clients = {
        "x": torch.randn(n, batch, features, generator=gen, requires_grad=True),
        "y": torch.randint(0, classes, (n, batch), generator=gen),  # int64, torch's default
    }
    return params, clients


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "auto"])
def test_int64_labels_give_the_loss_and_gradients_of_int32_labels(strategy):
    params, clients = _classification()
    inputs = [*params.values(), clients["x"]]
    with jax.enable_x64(False):
        int32 = {**clients, "y": clients["y"].to(torch.int32)}
        want = map_reduce(_cross_entropy, params, int32, strategy=strategy)
        want_grads = torch.autograd.grad(want, inputs)
        got = map_reduce(_cross_entropy, params, clients, strategy=strategy)
        got_grads = torch.autograd.grad(got, inputs)
    # The same program (auto measures each signature itself, and may pick another strategy).
    tol = 1e-6 if strategy == "auto" else 0
    assert_trees_all_close(got, want, rtol=tol, atol=tol)
    assert_trees_all_close(list(got_grads), list(want_grads), rtol=tol, atol=tol)
    log_p = torch.log_softmax(clients["x"] @ params["w"] + params["b"], dim=-1)
    torch_loss = -log_p.gather(-1, clients["y"][..., None]).mean()
    smooth = torch.nn.functional.one_hot(clients["y"], 5) * (
        clients["x"] @ params["w"] + params["b"]
    )
    torch_loss = torch_loss + 0.1 * smooth.sum(-1).mean()
    assert_trees_all_close(got, torch_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.x64
def test_with_x64_on_int64_labels_cross_as_they_are():
    params, clients = _classification()
    int32 = {**clients, "y": clients["y"].to(torch.int32)}
    want = map_reduce(_cross_entropy, params, int32, strategy="vmap")
    with dlpack.count_conversions() as stats:
        got = map_reduce(_cross_entropy, params, clients, strategy="vmap")
    assert stats.copies == 0
    assert_trees_all_close(got, want, rtol=0, atol=0)


def test_an_out_of_range_int64_label_names_the_leaf_and_the_fix():
    params, clients = _classification()
    clients["y"][2, 1] = 2**31
    expected = (
        "map_reduce: argument clients['y']: a torch.int64 tensor crosses to JAX as int32 while "
        "JAX's 64-bit mode is off, so its values must lie in [-2147483648, 2147483647]; it holds "
        '2147483648. Fix: enable x64 with jax.config.update("jax_enable_x64", True)'
    )
    with jax.enable_x64(False), pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        map_reduce(_cross_entropy, params, clients, strategy="vmap")


def _model_and_data(seed, n=4):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    gen = torch.Generator().manual_seed(seed)
    clients = {"x": torch.randn(n, 5, 3, generator=gen), "y": torch.randn(n, 5, generator=gen)}
    return model, clients


def _module_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["0.weight"].T + params["0.bias"])
    out = hidden @ params["2.weight"].T + params["2.bias"]
    return jnp.mean((out[:, 0] - batch["y"]) ** 2)


def _torch_module_loss(model, clients):
    per_client = [
        ((model(x)[:, 0] - y) ** 2).mean() for x, y in zip(clients["x"], clients["y"], strict=True)
    ]
    return torch.stack(per_client).mean()


def test_trains_an_nn_module_with_a_torch_optimizer_like_pure_torch():
    model, clients = _model_and_data(0)
    reference, _ = _model_and_data(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    for _ in range(5):
        opt.zero_grad()
        loss = map_reduce(_module_loss, dict(model.named_parameters()), clients)
        loss.backward()
        ref_opt.zero_grad()
        ref_loss = _torch_module_loss(reference, clients)
        ref_loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert_trees_all_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        opt.step()
        ref_opt.step()
        assert_trees_all_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_thousand_step_training_loop_compiles_once_and_keeps_memory_flat():
    model, clients = _model_and_data(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step():
        opt.zero_grad()
        map_reduce(_module_loss, dict(model.named_parameters()), clients).backward()
        opt.step()

    for _ in range(100):
        step()
    traces = bridge_mr.trace_counts()["map_reduce"]
    gc.collect()
    rss = _rss_mib()
    for _ in range(1000):
        step()
    gc.collect()
    assert bridge_mr.trace_counts()["map_reduce"] == traces
    growth = _rss_mib() - rss
    # Keeping each step's graph alive grows it by ~12 MiB here; a flat loop by ~0.
    assert growth < 5, f"peak RSS grew by {growth:.1f} MiB over 1000 steps"


def test_two_threads_train_two_models_at_once():
    def train(model, clients, results, seed):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(40):
            opt.zero_grad()
            map_reduce(_module_loss, dict(model.named_parameters()), clients).backward()
            opt.step()
        results[seed] = [p.detach().clone() for p in model.parameters()]

    # Models are built up front: their init draws from torch's global RNG, which two threads
    # seeding it at once would interleave.
    sequential, threaded = {}, {}
    for seed in (0, 1):
        train(*_model_and_data(seed, n=3 + seed), sequential, seed)
    setups = [(*_model_and_data(seed, n=3 + seed), threaded, seed) for seed in (0, 1)]
    threads = [threading.Thread(target=train, args=setup) for setup in setups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_trees_all_close(threaded, sequential, rtol=0, atol=0)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_over_a_mesh_equals_unsharded(axis_type):
    # float32: a sharded reduction may sum in another order than the unsharded one.
    close = {"rtol": 1e-5, "atol": 1e-6}
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(getattr(AxisType, axis_type),))
    params, clients, weights = _case(8)
    x = clients["x"].requires_grad_()
    server = {k: v.requires_grad_() for k, v in params.items()}

    def run(reduce="mean", **kwargs):
        loss = map_reduce(
            client_loss,
            server,
            clients,
            reduce=reduce,
            weights=weights if reduce == "weighted_mean" else None,
            **kwargs,
        )
        return loss, torch.autograd.grad(loss, [*server.values(), x])

    for reduce in ("mean", "weighted_mean"):
        want = run(reduce)
        with jax.set_mesh(mesh):
            assert_trees_all_close(run(reduce), want, **close)
    assert_trees_all_close(run(mesh=mesh), run(), **close)
    with torch.no_grad():
        assert_trees_all_close(
            map_reduce(client_loss, server, clients, reduce="weighted_mean", weights=weights),
            map_reduce(
                client_loss,
                server,
                clients,
                reduce="weighted_mean",
                weights=weights,
                mesh=mesh,
            ),
            **close,
        )
    with jax_core.program(placements={"clients": 8}):
        placed = broadcast(torch.ones(2, requires_grad=True), mesh=mesh)
    assert placed.shape == (8, 2)
    assert placed.device.type == "cpu"


# Client outputs that are not scalars (written for JAX and torch alike): backward takes a
# cotangent of their shape and reads forward's residuals (a scalar's gradient is fused instead).
VALUED = {"vector": lambda h: h.mean(0), "matrix": lambda h: h.T @ h / h.shape[0]}


@pytest.mark.parametrize("output", list(VALUED))
@pytest.mark.parametrize("axis_type", [None, "Auto", "Explicit"])
def test_vector_and_matrix_valued_rounds_over_a_mesh_equal_a_torch_loop(axis_type, output):
    mesh = None
    if axis_type is not None:
        mesh = jax.make_mesh((8,), ("clients",), axis_types=(getattr(AxisType, axis_type),))
    params, clients, _ = _case(8, width=3)
    # A scalar server leaf that scales: over an Explicit mesh, its residual came in another
    # order than the traced VJP read them (a broadcasting error; alike shapes: wrong gradients).
    server = {k: v.requires_grad_() for k, v in {**params, "s": torch.tensor(1.5)}.items()}
    x = clients["x"].requires_grad_()
    value = VALUED[output]

    def client(p, batch):
        return value(jnp.tanh(batch["x"] @ p["w"].T + p["b"]) * p["s"])

    traces = bridge_mr.trace_counts()["map_reduce"]
    got = map_reduce(client, server, clients, strategy="vmap", mesh=mesh)
    hidden = [torch.tanh(xi @ server["w"].T + server["b"]) * server["s"] for xi in x]
    want = torch.stack([value(h) for h in hidden]).mean(0)
    assert got.shape == want.shape == {"vector": (3,), "matrix": (3, 3)}[output]
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    inputs = [*server.values(), x]
    assert_trees_all_close(
        (got, torch.autograd.grad(got, inputs, cotangent)),
        (want, torch.autograd.grad(want, inputs, cotangent)),
        rtol=1e-5,
        atol=1e-6,
    )
    # Forward and backward traced once each: as the runner passes the tensors, over a mesh too.
    assert bridge_mr.trace_counts()["map_reduce"] == traces + 2
