"""Differential test: the same programs written against bridge_mr and the real drjax package."""

from __future__ import annotations

import math

import drjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax.sharding import PartitionSpec as P

from bridge_mr import jax_core as mr

# drjax 0.2.1 itself reads the deprecated legacy mesh; bridge_mr must not (no filter elsewhere).
pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)

N = 5


def _fedsgd_loss(api, params, data, weights):
    def client_loss(p, batch):
        x, y = batch
        hidden = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] - y) ** 2)

    placed = api.broadcast(params)
    losses = api.map_fn(lambda p, x, y: client_loss(p, (x, y)), (placed, *data))
    grads = api.map_fn(jax.grad(lambda p, x, y: client_loss(p, (x, y))), (placed, *data))
    return (
        api.reduce_mean(losses) + api.reduce_sum(losses) * 0.1,
        api.reduce_weighted_mean(grads, jax.tree.map(lambda _: weights, grads)),
    )


def _inputs():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(3, 4))),
        "b1": jnp.asarray(rng.normal(size=(4,))),
        "w2": jnp.asarray(rng.normal(size=(4, 1))),
    }
    data = (jnp.asarray(rng.normal(size=(N, 6, 3))), jnp.asarray(rng.normal(size=(N, 6, 1))))
    weights = jnp.asarray(rng.uniform(0.5, 2.0, size=(N,)))
    return params, data, weights


def _ours(params, data, weights):
    return mr.program(placements={"clients": N})(lambda *a: _fedsgd_loss(mr, *a))(
        params, data, weights
    )


def _theirs(params, data, weights):
    return drjax.program(placements={"clients": N})(lambda *a: _fedsgd_loss(drjax, *a))(
        params, data, weights
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_values_match_drjax(jit):
    wrap = jax.jit if jit else (lambda f: f)
    assert_trees_all_close(wrap(_ours)(*_inputs()), wrap(_theirs)(*_inputs()))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_match_drjax(jit):
    wrap = jax.jit if jit else (lambda f: f)

    def scalar(program):
        def loss(params, data, weights):
            value, grads = program(params, data, weights)
            return value + sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

        return wrap(jax.grad(loss, argnums=(0, 1, 2)))

    assert_trees_all_close(scalar(_ours)(*_inputs()), scalar(_theirs)(*_inputs()))


def test_sharded_values_match_drjax():
    mesh = jax.make_mesh((N,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        ours, theirs = jax.jit(_ours)(*_inputs()), jax.jit(_theirs)(*_inputs())
    assert_trees_all_close(ours, theirs)


# --- Explicit meshes, compared with drjax run eagerly (drjax refuses some of them under jit) ---

EXPLICIT = jax.sharding.AxisType.Explicit
CLIENTS = 3


def _explicit_programs(api):
    """One program per primitive on a value x [4, 2], client data [CLIENTS, 4, 2] and weights."""

    def mapped(x, data):
        return api.map_fn(lambda a, b: jnp.sin(a) * b, (api.broadcast(x), data))

    return {
        "broadcast": lambda x, data, w: api.broadcast(x) * 2.0,
        "map_fn": lambda x, data, w: mapped(x, data),
        "reduce_sum": lambda x, data, w: api.reduce_sum(mapped(x, data)),
        "reduce_mean": lambda x, data, w: api.reduce_mean(mapped(x, data)),
        "reduce_weighted_mean": lambda x, data, w: api.reduce_weighted_mean(mapped(x, data), w),
    }


def _explicit_inputs(mesh):
    rng = np.random.default_rng(5)
    x = jax.device_put(rng.normal(size=(4, 2)), jax.NamedSharding(mesh, P("model", "d")))
    data = jax.device_put(
        rng.normal(size=(CLIENTS, 4, 2)), jax.NamedSharding(mesh, P(None, "model", "d"))
    )
    return x, data, jnp.asarray(rng.uniform(0.5, 2.0, size=(CLIENTS,)))


def _grad_of(fn):
    return jax.grad(lambda *args: jnp.sum(fn(*args) ** 2), argnums=(0, 1, 2))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_explicit_programs(mr)))
def test_explicit_mesh_without_placement_axis_matches_drjax(name, jit):
    mesh = jax.make_mesh((4, 2), ("model", "d"), axis_types=(EXPLICIT,) * 2)
    wrap = jax.jit if jit else (lambda f: f)
    placements = {"clients": CLIENTS}
    ours = mr.program(placements=placements)(_explicit_programs(mr)[name])
    theirs = drjax.program(placements=placements)(_explicit_programs(drjax)[name])
    with jax.set_mesh(mesh):
        inputs = _explicit_inputs(mesh)
        got, expected = wrap(ours)(*inputs), theirs(*inputs)
        got_grads = wrap(_grad_of(ours))(*inputs)
    # drjax's gradients refuse this mesh (even eagerly): compare with its unsharded ones.
    expected_grads = _grad_of(theirs)(*(np.asarray(a) for a in inputs))
    placed_dims = (None,) if name in ("broadcast", "map_fn") else ()
    assert jax.typeof(got).sharding.spec == P(*placed_dims, "model", "d")
    assert jax.typeof(got).sharding.spec == jax.typeof(expected).sharding.spec
    assert jax.typeof(got_grads[0]).sharding.spec == P("model", "d")
    assert_trees_all_close(got, expected)
    assert_trees_all_close(got_grads, expected_grads)


def _weighted_mean_by_hand(x, w):
    """sum(x·w) / sum(w) and its gradients for the loss sum(c · mean), c = 1, 2, ..."""
    w_col = w.reshape(w.shape + (1,) * (x.ndim - 1))
    mean = (x * w_col).sum(0) / w.sum()
    c = np.arange(1.0, mean.size + 1).reshape(mean.shape)
    grad_x = np.broadcast_to(w_col * c / w.sum(), x.shape)
    grad_w = ((x - mean) * c).reshape(len(w), -1).sum(1) / w.sum()
    return mean, (grad_x, grad_w)


def _weighted_mean_case(shape, x_spec, w_spec):
    """bridge_mr's weighted mean (eager and jitted) and its gradients, on a clients x d mesh."""
    mesh = jax.make_mesh((4, 2), ("clients", "d"), axis_types=(EXPLICIT,) * 2)
    rng = np.random.default_rng(6)
    x_np, w_np = rng.normal(size=shape), rng.uniform(0.5, 2.0, size=(shape[0],))
    ours = mr.program(clients=shape[0])(mr.reduce_weighted_mean)
    c = jnp.arange(1.0, math.prod(shape[1:]) + 1).reshape(shape[1:])
    grad = jax.grad(lambda x, w: jnp.sum(ours(x, w) * c), argnums=(0, 1))

    # A None spec: an array made outside the mesh, whose type has no mesh at all.
    x, w = jnp.asarray(x_np), jnp.asarray(w_np)
    with jax.set_mesh(mesh):
        x = x if x_spec is None else jax.device_put(x, P(*x_spec))
        w = w if w_spec is None else jax.device_put(w, P(*w_spec))
        results = {jit: (wrap(ours)(x, w), wrap(grad)(x, w)) for jit, wrap in _WRAPS.items()}
    return (x_np, w_np), results


_WRAPS = {False: lambda f: f, True: jax.jit}


@pytest.mark.parametrize("shape", [(8, 2), (8, 2, 3)], ids=["2d", "3d"])
def test_weighted_mean_with_one_weight_vector_and_x_sharded_on_two_axes_matches_drjax(shape):
    (x_np, w_np), results = _weighted_mean_case(shape, P("clients", "d"), P("clients"))
    mesh = jax.make_mesh((4, 2), ("clients", "d"), axis_types=(EXPLICIT,) * 2)
    theirs = drjax.program(placements={"clients": 8})(lambda x, w: drjax.reduce_weighted_mean(x, w))
    with jax.set_mesh(mesh):
        x, w = jax.device_put(x_np, P("clients", "d")), jax.device_put(w_np, P("clients"))
        expected = theirs(x, w)
    for value, _ in results.values():
        assert jax.typeof(value).sharding.spec == jax.typeof(expected).sharding.spec
        assert_trees_all_close(value, expected)


@pytest.mark.parametrize(
    ("x_spec", "w_spec"),
    [
        (P("clients", "d"), P("clients")),
        (P(None, "d"), P("clients")),
        (P("clients", "d"), None),
        (None, P("clients")),
    ],
    ids=["both_sharded", "x_on_d_only", "w_off_mesh", "x_off_mesh"],
)
@pytest.mark.parametrize("shape", [(8, 2), (8, 2, 3)], ids=["2d", "3d"])
def test_weighted_mean_with_one_weight_vector_matches_hand_computation(shape, x_spec, w_spec):
    (x_np, w_np), results = _weighted_mean_case(shape, x_spec, w_spec)
    expected, expected_grads = _weighted_mean_by_hand(x_np, w_np)
    for value, grads in results.values():
        assert_trees_all_close(value, expected)
        assert_trees_all_close(grads, expected_grads)
