"""Bad input: each mistake gets an error that names the argument, what was expected, the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge_mr.torch_api import map_reduce, torch_function


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _case(n=3):
    params = {"w": torch.randn(2, requires_grad=True)}
    clients = {"x": torch.randn(n, 4, 2), "y": torch.randn(n, 4)}
    return params, clients


def test_tensors_on_different_devices():
    f = torch_function(lambda a, b: a + b)
    meta = torch.empty(3, device="meta")
    with pytest.raises(
        ValueError, match=r"different devices.*cpu: argument args\[0\].*meta: argument args\[1\]"
    ):
        f(torch.ones(3), meta)
    params, clients = _case()
    clients["y"] = clients["y"].to("meta")
    with pytest.raises(ValueError, match=r"cpu: argument server\['w'\].*meta: argument clients"):
        map_reduce(_loss, params, clients)


def test_client_leaves_with_disagreeing_leading_dims():
    params, clients = _case()
    clients["y"] = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"disagree on the number of clients.*3: clients\['x'\]"):
        map_reduce(_loss, params, clients)


def test_client_leaf_without_a_clients_axis():
    params, clients = _case()
    clients["y"] = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"clients\['y'\] has shape \(\)"):
        map_reduce(_loss, params, clients)


def test_weights_missing_for_weighted_mean():
    params, clients = _case()
    with pytest.raises(ValueError, match="needs weights=: one weight per client"):
        map_reduce(_loss, params, clients, reduce="weighted_mean")


def test_weights_with_the_wrong_shape():
    params, clients = _case()
    with pytest.raises(ValueError, match=r"weights has shape \(4,\); expected .* shape \(3,\)"):
        map_reduce(_loss, params, clients, reduce="weighted_mean", weights=torch.ones(4))


def test_weights_given_without_weighted_mean():
    params, clients = _case()
    with pytest.raises(ValueError, match="reduce='mean', which ignores weights"):
        map_reduce(_loss, params, clients, weights=torch.ones(3))


def test_unknown_reduce():
    params, clients = _case()
    with pytest.raises(
        ValueError, match=r"expected one of 'mean', 'sum', 'weighted_mean'; got 'max'"
    ):
        map_reduce(_loss, params, clients, reduce="max")


def test_fn_returning_a_non_array_leaf():
    params, clients = _case()
    with pytest.raises(TypeError, match=r"map_reduce\(fn\): fn returned a non-array leaf at "):
        map_reduce(lambda p, b: {"loss": _loss(p, b), "tag": "client"}, params, clients)
    f = torch_function(lambda x: (x, 1.5))
    with pytest.raises(TypeError, match=r"non-array leaf at output\[1\]: expected a JAX array"):
        f(torch.ones(2))


def test_fn_output_tree_changing_between_calls():
    params, clients = _case()
    shape = {"tree": "scalar"}

    def fickle(p, b):
        loss = _loss(p, b)
        return loss if shape["tree"] == "scalar" else {"loss": loss}

    map_reduce(fickle, params, clients)
    shape["tree"] = "dict"
    jax.clear_caches()  # Forces a retrace of the cached program, which now returns a dict.
    with pytest.raises(ValueError, match="output tree changed between two traces"):
        map_reduce(fickle, params, clients)


def test_jax_arrays_without_torch_tensors_or_as_tracers():
    f = torch_function(lambda x: x.sum())
    needs = r"args\[0\] \(shape \(2,\), float32, on cpu:0\): a torch function needs torch tensors"
    with pytest.raises(TypeError, match=needs + r".*Call the JAX function directly"):
        f(jnp.ones(2))
    with pytest.raises(TypeError, match=r"got a JAX tracer at args\[1\].*Call the JAX function"):
        jax.jit(lambda y: f(torch.ones(2), y))(jnp.ones(2))


def test_numpy_arrays_and_unhashable_static_values():
    f = torch_function(lambda x, y: x)
    with pytest.raises(TypeError, match=r"numpy array at args\[1\]; pass it as a torch tensor"):
        f(torch.ones(2), np.ones(2))
    with pytest.raises(TypeError, match=r"args\[1\] is a set, which is neither a torch tensor"):
        f(torch.ones(2), {1, 2})


def test_complex_tensor_requiring_grad():
    f = torch_function(lambda z: jnp.abs(z))
    z = torch.ones(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(TypeError, match="complex tensor that requires grad"):
        f(z)


@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_a_mesh_given_as_an_axis_name(strategy):
    params, clients = _case()
    with pytest.raises(
        TypeError,
        match=r"^map_reduce\(mesh=\.\.\.\): expected a jax\.sharding\.Mesh or AbstractMesh \(with "
        r"the placement axis 'clients'\).*; got str 'clients'\. Fix: pass the mesh itself, not an "
        r"axis name, e.g\. mesh=jax\.make_mesh\(\(jax\.device_count\(\),\), \('clients',\)\)",
    ):
        map_reduce(_loss, params, clients, mesh="clients", strategy=strategy)


@pytest.mark.parametrize("strategy", ["auto", "vmap"])
@pytest.mark.parametrize("leaf", ["server", "clients"])
def test_a_float64_tensor_with_x64_off_names_its_leaf(strategy, leaf):
    params, clients = _case()
    if leaf == "server":
        params["w"] = params["w"].double()
        name = r"server\['w'\]"
    else:
        clients["x"] = clients["x"].double()
        name = r"clients\['x'\]"
    with (
        jax.enable_x64(False),
        pytest.raises(
            TypeError,
            match=rf"^map_reduce: argument {name} has dtype torch\.float64; expected a dtype of at "
            r"most 32 bits while JAX's 64-bit mode is off.*Fix: enable x64",
        ),
    ):
        map_reduce(_loss, params, clients, strategy=strategy)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_a_quantized_tensor_names_its_leaf(strategy):
    params, clients = _case()
    params["w"] = torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.qint8)
    with pytest.raises(
        TypeError,
        match=r"^map_reduce: argument server\['w'\]: expected a tensor of a dtype JAX shares with "
        r"torch, got a torch\.qint8 tensor\. Fix: cast it",
    ):
        map_reduce(_loss, params, clients, strategy=strategy)
