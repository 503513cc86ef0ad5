"""The public torch API on torch-xla tensors: the same values and gradients as on CPU tensors.

Every entry point (torch_function, map_reduce, broadcast, map_fn, reduce_*) runs once on CPU
tensors (the DLPack path) and once on XLA tensors (embedded in torch-xla's graph), in float32
(the default leg) and in float64 (the x64 leg).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.precision import precisions
from jax.sharding import AbstractMesh, AxisType

import bridge_mr
from bridge_mr.runners import is_xla_tensor, torch_xla_global_mesh

pytestmark = pytest.mark.xla

# (dtype, tolerance): two XLA CPU builds (jaxlib's and torch-xla's) may differ in the last bits
# of tanh, exp, ...
PRECISIONS = precisions(
    float64={"rtol": 1e-10, "atol": 1e-12}, float32={"rtol": 1e-5, "atol": 1e-6}
)
N_CLIENTS = 3

Tensors = dict[str, torch.Tensor]


def _inputs(
    dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensors, Tensors, torch.Tensor]:
    """Server parameters, client data (3 clients) and client weights, on CPU."""
    gen = torch.Generator().manual_seed(seed)
    server = {
        "w": torch.randn(4, 3, generator=gen, dtype=dtype),
        "b": torch.randn(3, generator=gen, dtype=dtype),
    }
    clients = {
        "x": torch.randn(N_CLIENTS, 5, 4, generator=gen, dtype=dtype),
        "y": torch.randn(N_CLIENTS, 5, 3, generator=gen, dtype=dtype),
    }
    weights = torch.rand(N_CLIENTS, generator=gen, dtype=dtype) + 0.5
    return server, clients, weights


def _client_loss(server: dict[str, jax.Array], client: dict[str, jax.Array]) -> jax.Array:
    prediction = jnp.tanh(client["x"] @ server["w"] + server["b"])
    return jnp.mean((prediction - client["y"]) ** 2)


def _client_outputs(server: dict[str, jax.Array], client: dict[str, jax.Array]) -> Any:
    hidden = jnp.tanh(client["x"] @ server["w"] + server["b"])
    return {"hidden": hidden, "loss": jnp.mean((hidden - client["y"]) ** 2)}


def _on(device: Any, tree: Any, *, grad: bool) -> Any:
    """A copy of `tree` on `device`: fresh leaves, requiring grad if `grad`."""
    return jax.tree.map(lambda t: t.detach().to(device).requires_grad_(grad), tree)


def _run_both(
    xla: Any, compute: Callable[[Any], torch.Tensor], inputs: Any
) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """(outputs, input gradients) of `compute(inputs)` (a scalar) on CPU and on the XLA device."""
    results = []
    for device in ("cpu", xla.device()):
        leaves = _on(device, inputs, grad=True)
        output = compute(leaves)
        output.backward()
        xla.sync()
        assert is_xla_tensor(output) == (device != "cpu")
        results.append((output, jax.tree.map(lambda t: t.grad, leaves)))
    return results[0], results[1]


@pytest.mark.parametrize(("dtype", "tolerance"), PRECISIONS)
def test_torch_function_values_and_gradients_match_cpu(
    xla: Any, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    """Several non-scalar outputs: forward keeps VJP residuals, backward runs the VJP on them."""

    @bridge_mr.torch_function
    def layer(params: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
        hidden = jnp.tanh(x @ params["w"] + params["b"])
        return {"hidden": hidden, "norms": jnp.sum(hidden**2, axis=-1)}

    server, clients, _ = _inputs(dtype)
    x = clients["x"][0]
    cotangent = torch.linspace(-1, 1, 15, dtype=dtype).reshape(5, 3)

    def compute(inputs: Any) -> torch.Tensor:
        params, x = inputs
        out = layer(params, x)
        return (out["hidden"] * cotangent.to(x.device)).sum() + out["norms"].sum()

    cpu, on_xla = _run_both(xla, compute, (server, x))
    assert_trees_all_close(on_xla, cpu, **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), PRECISIONS)
def test_compilable_torch_function_matches_cpu(
    xla: Any, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    """The custom-op flavour (residuals cross as tensors), called eagerly on XLA tensors."""

    def layer(w: jax.Array, b: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        hidden = jnp.tanh(x @ w + b)
        return hidden, jnp.sum(hidden**2)

    op = bridge_mr.torch_function(layer, compilable=True)
    server, clients, _ = _inputs(dtype)

    def compute(inputs: Any) -> torch.Tensor:
        w, b, x = inputs
        hidden, norm = op(w, b, x)
        return hidden.sum() + norm

    cpu, on_xla = _run_both(xla, compute, (server["w"], server["b"], clients["x"][0]))
    assert_trees_all_close(on_xla, cpu, **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), PRECISIONS)
@pytest.mark.parametrize("reduce", ["mean", "sum", "weighted_mean"])
def test_map_reduce_values_and_gradients_match_cpu(
    xla: Any, reduce: str, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    server, clients, weights = _inputs(dtype)

    def compute(inputs: Any) -> torch.Tensor:
        server, clients, weights = inputs
        out = bridge_mr.map_reduce(
            _client_outputs,
            server,
            clients,
            reduce=reduce,
            weights=weights if reduce == "weighted_mean" else None,
        )
        return out["loss"] + out["hidden"].sum()

    cpu, on_xla = _run_both(xla, compute, (server, clients, weights))
    assert_trees_all_close(on_xla, cpu, **tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), PRECISIONS)
def test_placement_primitives_values_and_gradients_match_cpu(
    xla: Any, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    server, clients, weights = _inputs(dtype)
    outputs: dict[str, list[torch.Tensor]] = {}

    def compute(inputs: Any) -> torch.Tensor:
        server, clients, weights = inputs
        with bridge_mr.program(placements={"clients": N_CLIENTS}):
            placed = bridge_mr.broadcast(server)
            losses = bridge_mr.map_fn(_client_loss, (placed, clients))
            reduced = [
                bridge_mr.reduce_sum(losses),
                bridge_mr.reduce_mean(losses),
                bridge_mr.reduce_weighted_mean(losses, weights),
            ]
        outputs.setdefault(str(losses.device), []).extend([placed["w"], losses, *reduced])
        return sum(reduced) + placed["b"].sum()

    cpu, on_xla = _run_both(xla, compute, (server, clients, weights))
    assert_trees_all_close(on_xla, cpu, **tolerance)
    assert_trees_all_close(outputs[str(xla.device())], outputs["cpu"], **tolerance)
    assert outputs["cpu"][0].shape == (N_CLIENTS, 4, 3)


def _classifier_loss(server: dict[str, jax.Array], client: dict[str, jax.Array]) -> jax.Array:
    log_p = jax.nn.log_softmax(client["x"] @ server["w"] + server["b"])
    return -jnp.mean(jnp.take_along_axis(log_p, client["labels"][:, None], axis=1))


@pytest.mark.parametrize("compilable", [False, True], ids=["map_reduce", "custom_op"])
def test_int64_labels_on_xla_match_int32_labels_on_cpu(xla: Any, compilable: bool) -> None:
    server, clients, _ = _inputs()
    labels = torch.tensor([[0, 2, 1, 2, 0], [1, 1, 0, 2, 2], [2, 0, 0, 1, 1]])  # int64
    losses = []
    if compilable:
        op = bridge_mr.torch_function(
            lambda w, b, x, y: _classifier_loss({"w": w, "b": b}, {"x": x, "labels": y}),
            compilable=True,
        )
    for device, ids in (("cpu", labels.to(torch.int32)), (xla.device(), labels)):
        params = _on(device, server, grad=True)
        x = clients["x"][0].to(device)
        with jax.enable_x64(False):
            if compilable:
                loss = op(params["w"], params["b"], x, ids[0].to(device))
            else:
                batch = {"x": clients["x"].to(device), "labels": ids.to(device)}
                loss = bridge_mr.map_reduce(_classifier_loss, params, batch)
            loss.backward()
        xla.sync()
        losses.append((loss.detach().cpu(), {k: v.grad.cpu() for k, v in params.items()}))
    assert_trees_all_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_an_out_of_range_int64_label_on_xla_names_the_leaf(xla: Any) -> None:
    server, clients, _ = _inputs()
    labels = torch.zeros(N_CLIENTS, 5, dtype=torch.int64)
    labels[1, 2] = -(2**31) - 1
    batch = {"x": clients["x"].to(xla.device()), "labels": labels.to(xla.device())}
    params = _on(xla.device(), server, grad=True)
    with (
        jax.enable_x64(False),
        pytest.raises(
            ValueError,
            match=r"^map_reduce: argument clients\['labels'\]: a torch.int64 tensor crosses to "
            r"JAX as int32 .* it holds -2147483649\. Fix: enable x64",
        ),
    ):
        bridge_mr.map_reduce(_classifier_loss, params, batch)


@pytest.mark.x64
def test_gradcheck_on_the_xla_device(xla: Any) -> None:
    """Finite differences on XLA itself: residual path, fused scalar path, double backward."""
    server, clients, _ = _inputs(torch.float64)
    w, b = (t.to(xla.device()).requires_grad_(True) for t in (server["w"], server["b"]))
    data = {name: t.to(xla.device()) for name, t in clients.items()}

    @bridge_mr.torch_function
    def per_client(w: jax.Array, b: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ w + b), axis=1)

    def round_loss(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return bridge_mr.map_reduce(_client_loss, {"w": w, "b": b}, data)

    # fast_mode perturbs whole tensors along random directions: elementwise perturbations would
    # be graphs with different constants, each compiled anew.
    assert torch.autograd.gradcheck(
        lambda w, b: per_client(w, b, data["x"]), (w, b), fast_mode=True
    )
    assert torch.autograd.gradcheck(round_loss, (w, b), fast_mode=True)
    assert torch.autograd.gradgradcheck(round_loss, (w, b), fast_mode=True)


@pytest.mark.parametrize(("dtype", "tolerance"), PRECISIONS)
def test_hypergradient_through_create_graph_matches_cpu(
    xla: Any, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    """A gradient step inside the graph (create_graph=True), differentiated again."""
    server, clients, _ = _inputs(dtype)

    def compute(inputs: Any) -> torch.Tensor:
        server, clients = inputs
        loss = bridge_mr.map_reduce(_client_loss, server, clients)
        grads = torch.autograd.grad(loss, list(server.values()), create_graph=True)
        stepped = {name: p - 0.1 * g for (name, p), g in zip(server.items(), grads, strict=True)}
        return bridge_mr.map_reduce(_client_loss, stepped, clients)

    cpu, on_xla = _run_both(xla, compute, (server, clients))
    assert_trees_all_close(on_xla, cpu, **tolerance)


def test_xla_and_cpu_tensors_in_one_call_are_refused(xla: Any) -> None:
    server, clients, _ = _inputs()
    on_xla = _on(xla.device(), server, grad=False)
    mixed = r"different devices in one call \(xla:0: argument server\['b'\]"
    with pytest.raises(ValueError, match=mixed):
        bridge_mr.map_reduce(_client_loss, on_xla, clients)
    with (
        pytest.raises(ValueError, match="different devices"),
        bridge_mr.program(placements={"clients": N_CLIENTS}),
    ):
        bridge_mr.map_fn(_client_loss, (bridge_mr.broadcast(on_xla), clients))


def test_explicit_mesh_axes_are_refused_with_the_auto_spelling(xla: Any) -> None:
    server, clients, _ = _inputs()
    explicit = AbstractMesh((N_CLIENTS,), ("clients",), axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match="Explicit axes") as caught, torch.no_grad():
        bridge_mr.map_reduce(
            _client_loss,
            _on(xla.device(), server, grad=False),
            _on(xla.device(), clients, grad=False),
            mesh=explicit,
        )
    auto = f"AbstractMesh(({N_CLIENTS},), ('clients',), axis_types=(jax.sharding.AxisType.Auto,))"
    assert auto in str(caught.value)


def test_a_mesh_without_spmd_warns_and_computes_unsharded(xla: Any) -> None:
    server, clients, _ = _inputs(seed=1)
    auto = AbstractMesh((4,), ("clients",), axis_types=(AxisType.Auto,))
    on_xla = [_on(xla.device(), tree, grad=False) for tree in (server, clients)]
    assert torch_xla_global_mesh() is None  # SPMD is off in this process.
    with pytest.warns(UserWarning, match=r"SPMD mode is off.*use_spmd\(\) first thing"):
        sharded = bridge_mr.map_reduce(_client_outputs, *on_xla, mesh=auto)
    plain = bridge_mr.map_reduce(_client_outputs, *on_xla)
    assert_trees_all_close(sharded, plain, rtol=0, atol=0)
