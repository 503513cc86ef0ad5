"""A hostile user's catalogue: each input gets a correct result or an error naming the argument,
what was expected, what was given and the fix. One test per case; each asserts the outcome.
"""

from __future__ import annotations

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_trees_all_close
from jax.sharding import AxisType
from torch.testing._internal.two_tensor import TwoTensor

import bridge_mr


def _loss(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w"]) ** 2)


def _torch_loss(w, x):
    return torch.stack([torch.mean(torch.tanh(xi @ w) ** 2) for xi in x]).mean()


def _case(n=4):
    torch.manual_seed(0)
    return {"w": torch.randn(3, requires_grad=True)}, {"x": torch.randn(n, 5, 3)}


def _double(x):
    return x * 2


# --- map_reduce arguments ------------------------------------------------------------------


def test_zero_clients():
    server, _ = _case()
    with pytest.raises(ValueError, match=r"map_reduce\(clients\): the clients axis is empty "):
        bridge_mr.map_reduce(_loss, server, {"x": torch.randn(0, 5, 3)})


def test_string_leaf_in_server():
    server, clients = _case()
    with pytest.raises(
        TypeError, match=r"map_reduce\(server\): server\['tag'\] is a str .* closing over them"
    ):
        bridge_mr.map_reduce(_loss, {**server, "tag": "a"}, clients)


def test_string_leaf_in_clients():
    server, clients = _case()
    with pytest.raises(TypeError, match=r"map_reduce\(clients\): clients\['name'\] is a str"):
        bridge_mr.map_reduce(_loss, server, {**clients, "name": "alice"})


def test_numbers_in_server_are_broadcast_constants():
    server, clients = _case()
    out = bridge_mr.map_reduce(
        lambda p, b: _loss(p, b) * p["scale"], {**server, "scale": 2.0}, clients
    )
    assert_trees_all_close(out, 2 * _torch_loss(server["w"], clients["x"]), rtol=1e-5)


def test_fn_returning_none():
    server, clients = _case()
    with pytest.raises(
        TypeError, match=r"fn returned None, which holds no arrays.*forget a `return`"
    ):
        bridge_mr.map_reduce(lambda p, b: None, server, clients)


def test_fn_returning_an_empty_dict():
    server, clients = _case()
    with pytest.raises(TypeError, match=r"fn returned \{\}, which holds no arrays"):
        bridge_mr.map_reduce(lambda p, b: {}, server, clients)


def test_torch_function_returning_none_returns_none():
    assert bridge_mr.torch_function(lambda x: None)(torch.ones(2)) is None


def test_torch_operation_inside_fn():
    server, clients = _case()
    with pytest.raises(TypeError, match=r"a torch operation got a JAX value .* jax.numpy"):
        bridge_mr.map_reduce(lambda p, b: torch.sum(p["w"] * b["x"]), server, clients)


def test_mixed_dict_key_types():
    _, clients = _case()
    server = {1: torch.ones(3), "w": torch.ones(3)}
    with pytest.raises(
        TypeError, match=r"map_reduce: server is a dict whose keys are of mixed types \(1 \(int\)"
    ):
        bridge_mr.map_reduce(_loss, server, clients)


def test_mixed_dict_key_types_nested_in_clients():
    server, clients = _case()
    nested = {"x": clients["x"], "meta": {0: clients["x"], "a": clients["x"]}}
    with pytest.raises(TypeError, match=r"clients\['meta'\] is a dict whose keys are of mixed"):
        bridge_mr.map_reduce(_loss, server, nested)


# --- tensors JAX cannot take ------------------------------------------------------------------


def test_meta_tensors_are_named_by_their_path():
    server = {"w": torch.empty(3, device="meta")}
    clients = {"x": torch.empty(4, 5, 3, device="meta")}
    with pytest.raises(TypeError, match=r"argument server\['w'\] is a meta tensor .* no data"):
        bridge_mr.map_reduce(_loss, server, clients)


def test_sparse_coo_clients():
    server, clients = _case()
    with pytest.raises(TypeError, match=r"clients\['x'\] is a sparse_coo tensor .* \.to_dense\(\)"):
        bridge_mr.map_reduce(_loss, server, {"x": clients["x"].to_sparse()})


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_csr_server():
    _, clients = _case()
    server = {"w": torch.randn(2, 3).to_sparse_csr()}
    with pytest.raises(TypeError, match=r"server\['w'\] is a sparse_csr tensor"):
        bridge_mr.map_reduce(lambda p, b: jnp.sum(b["x"] @ p["w"].T), server, clients)


def test_sparse_after_a_dense_call_of_the_same_shape():
    f = bridge_mr.torch_function(jnp.sum)
    f(torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"args\[0\] is a sparse_coo tensor"):
        f(torch.ones(2, 3).to_sparse())


def test_wrapper_subclass_in_torch_function():
    x = TwoTensor(torch.randn(3), torch.randn(3))
    with pytest.raises(
        TypeError, match=r"args\[0\] is a TwoTensor, a tensor subclass with __torch_dispatch__"
    ):
        bridge_mr.torch_function(_double)(x)


def test_wrapper_subclass_in_map_reduce_clients():
    x = TwoTensor(torch.ones(4, 3), torch.ones(4, 3))
    with pytest.raises(TypeError, match=r"argument clients is a TwoTensor"):
        bridge_mr.map_reduce(lambda p, c: jnp.sum(p * c), torch.ones(3), x)


def test_wrapper_subclass_in_to_jax():
    with pytest.raises(TypeError, match=r"tree\[0\]: .* got a TwoTensor, a tensor subclass"):
        bridge_mr.dlpack.to_jax([TwoTensor(torch.randn(3), torch.randn(3))])


def test_plain_tensor_subclasses_are_fine():
    class Tagged(torch.Tensor):
        pass

    x = torch.randn(3).as_subclass(Tagged)
    assert_trees_all_close(bridge_mr.torch_function(_double)(x), 2 * x.as_subclass(torch.Tensor))
    p = torch.nn.Parameter(torch.randn(3))
    assert_trees_all_close(bridge_mr.torch_function(_double)(p), 2 * p.detach())


# --- static values ----------------------------------------------------------------------------


def test_int_and_float_statics_trace_apart():
    f = bridge_mr.torch_function(lambda a, n: jnp.full(a.shape, n) ** 2)
    x = torch.zeros(1)
    with jax.enable_x64(False):
        assert f(x, 100000).item() == 1410065408  # int32 wraps, as in JAX.
        assert f(x, 100000.0).item() == pytest.approx(1e10, rel=1e-6)
        assert f(x, 7).dtype == torch.int32
        assert f(x, 7.0).dtype == torch.float32


def test_signed_zero_statics_trace_apart():
    f = bridge_mr.torch_function(lambda a, s: a / s)
    assert f(torch.ones(1), 0.0).item() == np.inf
    assert f(torch.ones(1), -0.0).item() == -np.inf


def test_nan_static_hits_the_cache():
    f = bridge_mr.torch_function(lambda a, s: a + s)
    for _ in range(3):
        f(torch.ones(1), float("nan"))
    assert f.trace_count == 1


def test_x64_toggled_between_calls():
    f = bridge_mr.torch_function(lambda a: (a, jnp.arange(3.0)))
    x = torch.ones(3, dtype=torch.float32)
    with jax.enable_x64(False):
        assert f(x)[1].dtype == torch.float32
    with jax.enable_x64(True):
        assert f(x)[1].dtype == torch.float64  # jnp.arange(3.0) is float64 with x64 on.
    with jax.enable_x64(False):
        assert f(x)[1].dtype == torch.float32
    assert f.trace_count == 2


# --- weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, float("nan"), 1.0, 1.0], r"1 non-finite value\(s\) \(nan at client 1\)"),
        ([1.0, float("inf"), 1.0, 1.0], r"1 non-finite value\(s\) \(inf at client 1\)"),
        ([0.0, 0.0, 0.0, 0.0], r"weights sum to zero"),
        ([1.0, -1.0, 2.0, -2.0], r"weights sum to zero \(\[ 1., -1.,  2., -2.\]\)"),
    ],
)
def test_bad_weights(weights, message):
    server, clients = _case()
    with pytest.raises(
        ValueError, match=rf"map_reduce\(weights\): .*{message}.*check_weights=False"
    ):
        bridge_mr.map_reduce(
            _loss, server, clients, reduce="weighted_mean", weights=torch.tensor(weights)
        )


def test_bad_weights_opt_out_gives_ieee_results():
    server, clients = _case()
    weights = torch.tensor([1.0, -1.0, 2.0, -2.0])
    out = bridge_mr.map_reduce(
        _loss, server, clients, reduce="weighted_mean", weights=weights, check_weights=False
    )
    assert not torch.isfinite(out)


def test_tree_weights_summing_to_zero_at_some_positions():
    server, clients = _case()
    weights = {"a": torch.ones(4, 3)}
    weights["a"][:, 1] = torch.tensor([1.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"weights\['a'\] sum to zero over the clients at 1 of 3"):
        bridge_mr.map_reduce(
            lambda p, b: {"a": b["x"][0] * p["w"]},
            server,
            clients,
            reduce="weighted_mean",
            weights=weights,
        )


def test_jax_weights_are_checked_too():
    w = jnp.ones(3)
    with pytest.raises(ValueError, match="non-finite"):
        bridge_mr.map_reduce(
            lambda p, c: p * c,
            w,
            jnp.ones((4, 3)),
            reduce="weighted_mean",
            weights=jnp.array([1.0, jnp.nan, 1, 1]),
        )


# --- meshes -----------------------------------------------------------------------------------


def test_explicit_mesh_that_does_not_divide_the_clients():
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Explicit,))
    server, _ = _case()
    with pytest.raises(ValueError, match=r"'clients' has size 6.*axis 'clients' of size 8"):
        bridge_mr.map_reduce(_loss, server, {"x": torch.randn(6, 5, 3)}, mesh=mesh)


# --- torch transforms and compilation ---------------------------------------------------------


def test_fullgraph_compile_points_to_the_compilable_path():
    _, clients = _case()
    compiled = torch.compile(
        lambda w: bridge_mr.map_reduce(_loss, {"w": w}, clients), fullgraph=True, backend="eager"
    )
    with pytest.raises(Exception, match=r"torch_function\(jax_fn, compilable=True\)"):
        compiled(torch.randn(3))


# torch.func.jvp's first use scripts a helper with the deprecated torch.jit.script.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torch_func_jvp():
    server, clients = _case()
    w, t = server["w"].detach(), torch.randn(3)
    out, tangent = torch.func.jvp(
        lambda s: bridge_mr.map_reduce(_loss, {"w": s}, clients), (w,), (t,)
    )
    ref, ref_tangent = torch.func.jvp(lambda s: _torch_loss(s, clients["x"]), (w,), (t,))
    assert_trees_all_close((out, tangent), (ref, ref_tangent), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_with_dual_tensors():
    import torch.autograd.forward_ad as fwad

    server, clients = _case()
    w, t = server["w"].detach(), torch.randn(3)
    _, ref_tangent = torch.func.jvp(lambda s: _torch_loss(s, clients["x"]), (w,), (t,))
    with fwad.dual_level():
        out = bridge_mr.map_reduce(_loss, {"w": fwad.make_dual(w, t)}, clients)
        assert_trees_all_close(fwad.unpack_dual(out).tangent, ref_tangent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", [torch.func.grad, torch.func.vmap])
def test_torch_func_over_a_compilable_function(transform):
    f = bridge_mr.torch_function(lambda a: jnp.sum(jnp.sin(a)), compilable=True)
    with pytest.raises(NotImplementedError, match=r"is compilable .* without compilable=True"):
        transform(f)(torch.randn(3))


def test_jacrev_explains_and_names_the_function():
    f = bridge_mr.torch_function(jnp.sin)
    with pytest.raises(NotImplementedError, match=r"over the VJP of torch_function\(sin\).*jacrev"):
        torch.func.jacrev(f)(torch.randn(3))


def test_second_backward_after_an_in_place_change_names_retain_graph():
    f = bridge_mr.torch_function(lambda a: jnp.sum(a**3))
    a = torch.randn(3, requires_grad=True)
    b = a * 1
    out = f(b)
    out.backward(retain_graph=True)
    with torch.no_grad():
        b.mul_(3)
    with pytest.raises(RuntimeError, match=r"modified in place .* retain_graph=True"):
        out.backward()


def test_complex_output_beside_a_real_one_backward():
    f = bridge_mr.torch_function(lambda a: (a.astype(jnp.complex64) * 1j, jnp.sum(a**2)))
    a = torch.randn(5, requires_grad=True)
    _, total = f(a)
    total.backward()
    assert_trees_all_close(a.grad, 2 * a.detach())


# --- copies, pickling, guards, introspection --------------------------------------------------


def test_deepcopy_gives_an_independent_function():
    f = bridge_mr.torch_function(_double)
    f(torch.ones(2))
    clone = copy.deepcopy(f)
    assert clone.trace_count == 0
    assert_trees_all_close(clone(torch.ones(2)), 2 * torch.ones(2))


def test_pickle_round_trip():
    f = bridge_mr.torch_function(_double)
    f(torch.ones(2))
    restored = pickle.loads(pickle.dumps(f))
    assert restored.trace_count == 0
    assert_trees_all_close(restored(torch.ones(2)), 2 * torch.ones(2))


def test_pickle_of_a_local_function_says_why():
    f = bridge_mr.torch_function(lambda x: x)
    with pytest.raises(
        pickle.PicklingError, match=r"its JAX function .* cannot be pickled.*module level"
    ):
        pickle.dumps(f)


def test_transfer_guard_disallow_passes_zero_copy_calls():
    server, clients = _case()
    expected = bridge_mr.map_reduce(_loss, server, clients)
    with jax.transfer_guard("disallow"):
        out = bridge_mr.map_reduce(_loss, server, clients)
    assert_trees_all_close(out, expected)


def test_trace_counts_are_public():
    server, clients = _case(3)
    before = bridge_mr.trace_counts()
    for _ in range(3):
        bridge_mr.map_reduce(_loss, server, clients).backward()
    after = bridge_mr.trace_counts()
    assert after["map_reduce"] - before["map_reduce"] == 1  # One fused value-and-grad trace.
    assert set(after) == {
        "map_reduce",
        "broadcast",
        "map_fn",
        "reduce_sum",
        "reduce_mean",
        "reduce_weighted_mean",
    }


# --- low-precision reductions -----------------------------------------------------------------


def test_float16_mean_accumulates_in_float32_like_torch():
    values = torch.full((4, 2), 30000.0, dtype=torch.float16)
    with bridge_mr.program(placements={"clients": 4}):
        assert_trees_all_close(bridge_mr.reduce_mean(values), values.mean(0))
    out = bridge_mr.map_reduce(lambda p, c: c * p, torch.ones(2, dtype=torch.float16), values)
    assert out.dtype == torch.float16
    assert_trees_all_close(out, values.mean(0))
