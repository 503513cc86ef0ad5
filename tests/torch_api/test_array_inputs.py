"""JAX arrays as inputs of torch calls: data already where the program runs (issue 41's data on
the chip; here the CPU, where programs of host tensors run without an accelerator). They go to
the program as they are (no conversion, no copy), are keyed by shape, dtype and sharding, and
are not differentiated; values and gradients equal those of the same data as torch tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge_mr
from bridge_mr import dlpack
from bridge_mr.torch_api import map_reduce, torch_function

STRATEGIES = [{"strategy": "vmap"}, {"strategy": "per_client"}, {"chunk_size": 2}, {}]


def _loss(p, c):
    return jnp.mean(jnp.tanh(c["x"] @ p["w"] + p["b"]) * c["y"])


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(3, 2, generator=g).requires_grad_(True),
        "b": torch.randn(2, generator=g).requires_grad_(True),
    }
    clients = {"x": torch.randn(5, 4, 3, generator=g), "y": torch.randn(5, 4, 2, generator=g)}
    return params, clients


def _on_jax(tree):
    return {k: jnp.asarray(v.numpy()) for k, v in tree.items()}


def _grads(params):
    grads = {k: p.grad.clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads


@pytest.mark.parametrize("options", STRATEGIES, ids=["vmap", "per_client", "chunks", "auto"])
def test_map_reduce_on_jax_client_data_equals_torch_client_data(options):
    params, clients = _case()
    expected = map_reduce(_loss, params, clients, **options)
    expected.backward()
    expected_grads = _grads(params)
    loss = map_reduce(_loss, params, _on_jax(clients), **options)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for k, g in _grads(params).items():
        torch.testing.assert_close(g, expected_grads[k], rtol=1e-5, atol=1e-6)


def test_only_the_tensors_cross():
    params, _ = _case()
    g = torch.Generator().manual_seed(2)
    big = {"x": torch.randn(5, 2000, 3, generator=g), "y": torch.randn(5, 2000, 2, generator=g)}
    # Past the first call, the small parameters cross through a staging buffer (no import);
    # x and y, over the packing size, are imported one by one as tensors, and not at all as
    # JAX arrays, which go in as they are.
    for clients, imports in ((big, 2), (_on_jax(big), 0)):
        for _ in range(2):  # The first call, then a repeated one.
            with dlpack.count_conversions() as counts:
                map_reduce(_loss, params, clients, strategy="vmap").backward()
        assert (counts.imports, counts.copies) == (imports, 0)


def test_residual_path_second_order_and_no_grad():
    f = torch_function(lambda w, x: jnp.sin(x @ w))  # a matrix output: the VJP over residuals
    w = torch.randn(3, 2, dtype=torch.float32, requires_grad=True)
    x_np = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x_t, x_j = torch.from_numpy(x_np), jnp.asarray(x_np)
    out_t, out_j = f(w, x_t), f(w, x_j)
    torch.testing.assert_close(out_j, out_t)
    probe = torch.randn(4, 2)
    (g_t,) = torch.autograd.grad((out_t * probe).sum(), w, create_graph=True)
    (g_j,) = torch.autograd.grad((out_j * probe).sum(), w, create_graph=True)
    torch.testing.assert_close(g_j, g_t)
    # Second order: the VJP recomputed from the inputs, the JAX array among them.
    (h_t,) = torch.autograd.grad(g_t.square().sum(), w)
    (h_j,) = torch.autograd.grad(g_j.square().sum(), w)
    torch.testing.assert_close(h_j, h_t, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(f(w, x_j), out_t.detach())


# torch.func.jvp's first use scripts a helper with the deprecated torch.jit.script.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_through_jax_array_inputs():
    f = torch_function(lambda w, x: jnp.sin(x @ w))
    w, tangent = torch.randn(3, 2), torch.randn(3, 2)
    x_np = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    _, expected = torch.func.jvp(lambda w: f(w, torch.from_numpy(x_np)), (w,), (tangent,))
    _, found = torch.func.jvp(lambda w: f(w, jnp.asarray(x_np)), (w,), (tangent,))
    torch.testing.assert_close(found, expected)


def test_new_arrays_of_one_signature_reuse_the_trace_and_other_shapes_trace_again():
    f = torch_function(lambda w, x: (x @ w).sum())
    w = torch.ones(3, requires_grad=True)
    for value in (1.0, 2.0, 3.0):  # new arrays, new values: one trace, right values
        out = f(w, jnp.full((2, 3), value))
        assert out.item() == pytest.approx(6 * value)
    traces = f.trace_count
    f(w, jnp.ones((4, 3)))
    assert f.trace_count > traces  # another shape: another program
    traces = f.trace_count
    f(w, jnp.ones((4, 3), jnp.bfloat16).astype(jnp.float32))
    assert f.trace_count == traces


def test_jax_arrays_elsewhere_than_the_program_are_refused_naming_the_argument():
    params, clients = _case()
    data = _on_jax(clients)
    data["x"] = jax.device_put(data["x"], jax.devices("cpu")[1])
    where = r"clients\['x'\] \(shape \(5, 4, 3\), float32, on cpu:1\)"
    with pytest.raises(TypeError, match=where + r": this call's program runs on cpu:0.*device_put"):
        map_reduce(_loss, params, data, strategy="vmap")


def test_jax_arrays_with_a_mesh_are_refused_with_the_fix():
    params, clients = _case()
    mesh = jax.make_mesh((8,), ("clients",), devices=jax.devices("cpu")[:8])
    clients = {k: torch.cat([v, v[:3]]) for k, v in clients.items()}  # 8 clients
    with pytest.raises(TypeError, match=r"clients\['x'\].*not with a mesh.*torch tensor"):
        map_reduce(_loss, params, _on_jax(clients), mesh=mesh, strategy="vmap")


def test_a_jax_array_server_value_is_an_input_not_a_constant():
    """A JAX array in the server tree (a frozen embedding, say): a new value is seen."""
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(4, 3)

    def loss(server, client):
        return jnp.sum(client @ (server["w"] * server["scale"]))

    for scale in (1.0, 2.0):
        out = bridge_mr.map_reduce(loss, {"w": w, "scale": jnp.full(3, scale)}, x)
        assert out.item() == pytest.approx(3 * scale)


def test_weak_types_and_typed_prng_keys():
    f = torch_function(lambda t, a: t * a)
    t = torch.ones(3, dtype=torch.bfloat16)
    with jax.numpy_dtype_promotion("standard"):  # The suite runs with "strict".
        assert f(t, jnp.asarray(2.0, jnp.float32)).dtype == torch.float32  # float32 wins
        assert f(t, jnp.array(2.0)).dtype == torch.bfloat16  # a weak scalar takes t's dtype
    w = torch.ones(3, requires_grad=True)

    def noisy(server, key):
        return jnp.sum(server * jax.random.normal(key, (3,)))

    keys = jax.random.split(jax.random.key(0), 4)  # per-client typed keys
    out = map_reduce(noisy, w, keys, strategy="vmap")
    out.backward()
    expected = jnp.mean(jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys), axis=0)
    np.testing.assert_allclose(w.grad.numpy(), np.asarray(expected), rtol=1e-6)


def test_a_compilable_function_refuses_jax_arrays_with_the_fix():
    f = torch_function(lambda x, y: x + y, compilable=True)
    with pytest.raises(TypeError, match=r"argument 1 is a jax.Array.*compilable=False"):
        f(torch.ones(2), jnp.ones(2))
