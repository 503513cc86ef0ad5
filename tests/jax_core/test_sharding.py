"""Placed values on 8 CPU devices: meshes with and without the placement axis, Auto and Explicit."""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr import jax_core as mr

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
MESHES = {
    "clients8": ((8,), ("clients",)),
    "clients4_model2": ((4, 2), ("clients", "model")),
    "one_by_one": ((1, 1), ("clients", "model")),
}


def _mesh(name, axis_type):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _round(x, y):
    """broadcast → map (a matmul with the client data) → every reduction."""
    placed = mr.broadcast(x)
    mapped = mr.map_fn(lambda a, b: jnp.tanh(b @ a), (placed, y))
    return placed, mapped, mr.reduce_sum(mapped), mr.reduce_mean(mapped)


def _inputs(n):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(6, 4))), jnp.asarray(rng.normal(size=(n, 5, 6)))


def _unsharded_reference(n, x, y):
    return mr.program(clients=n)(_round)(x, y)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_placed_values_are_sharded_along_placement_axis(mesh_name, axis_type, jit):
    mesh = _mesh(mesh_name, axis_type)
    n = mesh.shape["clients"] * 2
    x, y = _inputs(n)
    fn = mr.program(clients=n)(_round)
    with jax.set_mesh(mesh):
        placed, mapped, summed, mean = (jax.jit(fn) if jit else fn)(x, y)
    placed_spec = NamedSharding(mesh, P("clients"))
    assert placed.sharding.is_equivalent_to(placed_spec, placed.ndim)
    assert mapped.sharding.is_equivalent_to(placed_spec, mapped.ndim)
    assert summed.sharding.is_equivalent_to(NamedSharding(mesh, P()), summed.ndim)
    assert_trees_all_close((placed, mapped, summed, mean), _unsharded_reference(n, x, y))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mesh_argument_wins_over_ambient_mesh(jit):
    mesh = _mesh("clients8", AUTO)
    fn = mr.program(clients=8)(lambda x: mr.broadcast(x, mesh=mesh))
    out = (jax.jit(fn) if jit else fn)(jnp.ones(3))
    assert out.sharding.spec[0] == "clients"
    assert len(out.sharding.device_set) == 8


def test_legacy_with_mesh_context_is_honoured():
    mesh = _mesh("clients8", AUTO)
    fn = jax.jit(mr.program(clients=8)(mr.broadcast))
    with warnings.catch_warnings():
        # `with mesh:` itself is deprecated in JAX; bridge_mr must still honour it.
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            out = fn(jnp.ones(3))
    assert out.sharding.spec[0] == "clients"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_auto_mesh_without_placement_axis_is_unconstrained(jit):
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AUTO,))
    x, y = _inputs(4)
    fn = mr.program(clients=4)(_round)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no log or warning spam
        with jax.set_mesh(mesh):
            out = (jax.jit(fn) if jit else fn)(x, y)
    assert_trees_all_close(out, _unsharded_reference(4, x, y))


def test_non_placement_dims_keep_input_sharding_explicit():
    mesh = _mesh("clients4_model2", EXPLICIT)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P(None, "model")))
        out = jax.jit(mr.program(clients=4)(mr.broadcast))(x)
    assert out.sharding.spec == P("clients", None, "model")


def test_non_placement_dims_keep_input_sharding_auto():
    mesh = _mesh("clients4_model2", AUTO)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P(None, "model")))
        out = jax.jit(mr.program(clients=4)(mr.broadcast))(x)
    assert out.sharding.spec == P("clients", None, "model")


def test_eval_shape_reports_explicit_sharding():
    mesh = _mesh("clients4_model2", EXPLICIT)
    x, y = _inputs(4)
    fn = mr.program(clients=4)(_round)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(fn, x, y)
        real = jax.jit(fn)(x, y)
    for a, r in zip(abstract, real, strict=True):
        assert (a.shape, a.dtype, a.sharding.spec) == (r.shape, r.dtype, r.sharding.spec)


def test_model_parallel_matmul_inside_map_fn_keeps_its_sharding():
    mesh = _mesh("clients4_model2", AUTO)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(6, 8)))
    data = jnp.asarray(rng.normal(size=(4, 5, 6)))

    def client(w, batch):
        w = jax.lax.with_sharding_constraint(w, P(None, "model"))
        hidden = jax.lax.with_sharding_constraint(batch @ w, P(None, "model"))
        return hidden

    @jax.jit
    @mr.program(clients=4)
    def fn(w, data):
        return mr.map_fn(client, (mr.broadcast(w), data))

    with jax.set_mesh(mesh):
        out = fn(w, data)
    assert out.sharding.spec == P("clients", None, "model")
    assert_trees_all_close(out, np.einsum("cbi,io->cbo", data, w))


def test_shard_map_inside_map_fn():
    mesh = _mesh("clients4_model2", AUTO)
    data = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8)

    def client(row):
        # A model-parallel sum: each "model" shard sums its half, then psum.
        return jax.shard_map(
            lambda part: jax.lax.psum(part.sum(keepdims=True), "model"),
            in_specs=P("model"),
            out_specs=P(),
        )(row)

    @jax.jit
    @mr.program(clients=4)
    def fn(data):
        return mr.reduce_sum(mr.map_fn(client, data))

    with jax.set_mesh(mesh):
        out = fn(data)
    np.testing.assert_allclose(np.asarray(out), [float(data.sum())])


def test_gradients_under_explicit_mesh_match_unsharded():
    mesh = _mesh("clients4_model2", EXPLICIT)
    x, y = _inputs(4)

    def loss(x, y):
        return mr.reduce_mean(mr.map_fn(lambda a, b: jnp.tanh(b @ a).sum(), (mr.broadcast(x), y)))

    fn = jax.jit(jax.grad(mr.program(clients=4)(loss), argnums=(0, 1)))
    expected = fn(x, y)
    with jax.set_mesh(mesh):
        sharded = fn(x, y)
    assert sharded[1].sharding.spec[0] == "clients"
    assert_trees_all_close(sharded, expected)


# Client outputs that are not scalars: their VJP takes a cotangent of their shape.
VALUED = {"vector": lambda h: h.mean(0), "matrix": lambda h: h.T @ h / h.shape[0]}


@pytest.mark.parametrize("output", list(VALUED))
@pytest.mark.parametrize("axis_type", [None, AUTO, EXPLICIT], ids=["no_mesh", "auto", "explicit"])
def test_vector_and_matrix_valued_rounds_match_plain_jax(axis_type, output):
    x, y = _inputs(8)

    def client(a, b):
        return VALUED[output](jnp.tanh(b @ a))

    @mr.program(clients=8)
    def ours(x, y):
        return mr.reduce_mean(mr.map_fn(client, (mr.broadcast(x), y)))

    def plain(x, y):
        return jax.vmap(client, in_axes=(None, 0))(x, y).mean(0)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_vjp(fn, x, y, cotangent):
        value, vjp = jax.vjp(fn, x, y)
        return value, vjp(cotangent)

    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=jax.eval_shape(plain, x, y).shape))
    want = value_and_vjp(plain, x, y, cotangent)
    with jax.set_mesh(_mesh("clients8", axis_type)) if axis_type else contextlib.nullcontext():
        got = value_and_vjp(ours, x, y, cotangent)
        rounds = value_and_vjp(functools.partial(mr.map_reduce, client), x, y, cotangent)
    assert got[0].shape == want[0].shape == {"vector": (4,), "matrix": (4, 4)}[output]
    assert_trees_all_close(got, want)
    assert_trees_all_close(rounds, want)


def _weighted_loss(x, w, mesh=None):
    placed = mr.map_fn(lambda a: jnp.sin(a) * 2.0, x, mesh=mesh)
    return mr.reduce_weighted_mean(placed, w).sum()


def _weighted_inputs():
    rng = np.random.default_rng(3)
    return jnp.asarray(rng.normal(size=(8, 3))), jnp.asarray(rng.uniform(0.5, 2.0, size=(8,)))


def test_weighted_mean_gradients_with_sharded_values_and_unsharded_weights_explicit():
    mesh = _mesh("clients8", EXPLICIT)
    x, w = _weighted_inputs()
    grad = jax.jit(jax.grad(mr.program(clients=8)(_weighted_loss), argnums=(0, 1)))
    expected = grad(x, w)
    with jax.set_mesh(mesh):
        x_sharded = jax.device_put(x, NamedSharding(mesh, P("clients")))
        got = grad(x_sharded, w)
    assert got[0].sharding.spec[0] == "clients"
    assert_trees_all_close(got, expected)


def test_weighted_mean_gradients_with_an_explicit_mesh_argument():
    mesh = _mesh("clients8", EXPLICIT)
    x, w = _weighted_inputs()
    expected = jax.grad(mr.program(clients=8)(_weighted_loss), argnums=(0, 1))(x, w)
    replicated = NamedSharding(mesh, P())
    loss = mr.program(clients=8)(lambda x, w: _weighted_loss(x, w, mesh=mesh))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(*jax.device_put((x, w), replicated))
    assert_trees_all_close(got, expected)


# --- meshes mixing Auto and Explicit axes; placement sizes the mesh axis does not divide ------

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
MIXED = {"clients_explicit_d_auto": (EXPLICIT, AUTO), "clients_auto_d_explicit": (AUTO, EXPLICIT)}


def _full_round(x, y, w):
    """_round with the weighted mean: every primitive of the API."""
    placed, mapped, summed, mean = _round(x, y)
    return placed, mapped, summed, mean, mr.reduce_weighted_mean(mapped, w)


def _full_loss(x, y, w):
    _, _, summed, mean, weighted = _full_round(x, y, w)
    return jnp.sum(summed**2) + jnp.sum(jnp.sin(mean)) + jnp.sum(weighted * mean)


def _full_inputs(n):
    x, y = _inputs(n)
    return x, y, jnp.asarray(np.random.default_rng(7).uniform(0.5, 2.0, size=(n,)))


# float32 gradients of squared sums, sharded against unsharded: reordered sums differ by tens of
# ulps.
ROUND_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _run_on_mesh(mesh, n, jit, x_spec):
    """Values and gradients of _full_round on `mesh`, and the same without any mesh."""
    wrap = jax.jit if jit else (lambda f: f)
    fn = mr.program(clients=n)(_full_round)
    grad = jax.grad(mr.program(clients=n)(_full_loss), argnums=(0, 1, 2))
    x, y, w = _full_inputs(n)
    expected = fn(x, y, w), grad(x, y, w)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, x_spec))
        got = wrap(fn)(x, y, w), wrap(grad)(x, y, w)
    return got, expected


@JIT
@pytest.mark.parametrize("axis_types", list(MIXED.values()), ids=list(MIXED))
def test_meshes_mixing_auto_and_explicit_axes(axis_types, jit):
    mesh = jax.make_mesh((4, 2), ("clients", "d"), axis_types=axis_types)
    got, expected = _run_on_mesh(mesh, 8, jit, x_spec=P(None, "d"))
    placed, mapped, *_ = got[0]
    for value in (placed, mapped):
        assert value.sharding.spec[0] == "clients"
    typed = P("clients", None, None) if axis_types[0] == EXPLICIT else P(None, None, "d")
    assert jax.typeof(placed).sharding.spec == typed
    assert_trees_all_close(got, expected, **ROUND_TOL)


@JIT
@pytest.mark.parametrize(
    "axis_types", [(AUTO, AUTO), (AUTO, EXPLICIT)], ids=["auto", "clients_auto_d_explicit"]
)
def test_auto_placement_axis_that_does_not_divide_the_placement_size(axis_types, jit):
    # 6 clients over 4 devices: XLA pads the placement axis inside the computation.
    mesh = jax.make_mesh((4, 2), ("clients", "d"), axis_types=axis_types)
    got, expected = _run_on_mesh(mesh, 6, jit, x_spec=P())
    assert_trees_all_close(got, expected, **ROUND_TOL)


@JIT
def test_mixed_mesh_without_placement_axis_keeps_other_shardings(jit):
    # All-Explicit meshes without the placement axis: test_drjax_parity.py.
    mesh = jax.make_mesh((4, 2), ("model", "d"), axis_types=(EXPLICIT, AUTO))
    got, expected = _run_on_mesh(mesh, 3, jit, x_spec=P(None, "model"))
    (placed, *_), grads = got
    assert jax.typeof(placed).sharding.spec == P(None, None, "model")
    assert jax.typeof(grads[0]).sharding.spec == P(None, "model")
    assert_trees_all_close(got, expected, **ROUND_TOL)
