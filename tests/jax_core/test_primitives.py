"""The three primitives: values, dtypes, abstract eval, AD (closure under transpose), batching."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax.test_util import check_grads

from bridge_mr import jax_core as mr

N = 4
DTYPES = [
    jnp.float32,
    pytest.param(jnp.float64, marks=pytest.mark.x64),
    jnp.bfloat16,
    jnp.int32,
    jnp.int8,
    jnp.bool_,
]
# What bools count in (sum) and what integers average to (mean): JAX's defaults, 64-bit with x64.
DEFAULT_INT = jax.dtypes.canonicalize_dtype(jnp.int64)
DEFAULT_FLOAT = jax.dtypes.canonicalize_dtype(jnp.float64)
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


def _value(dtype, shape=(3, 2), seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(-3, 4, size=shape)).astype(dtype)


def _placed(dtype, shape=(3, 2), seed=0):
    return _value(dtype, (N, *shape), seed)


@JIT
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_repeats_along_new_leading_axis(dtype, jit):
    x = _value(dtype)
    out = _maybe_jit(mr.program(clients=N)(mr.broadcast), jit)(x)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.asarray(x), (N, 3, 2)))


@JIT
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_sum_keeps_dtype_and_counts_bools(dtype, jit):
    x = _placed(dtype)
    out = _maybe_jit(mr.program(clients=N)(mr.reduce_sum), jit)(x)
    expected_dtype = DEFAULT_INT if dtype == jnp.bool_ else dtype
    assert out.dtype == expected_dtype
    expected = np.asarray(x).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, rtol=1e-2)


@JIT
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_mean_gives_floats_for_ints(dtype, jit):
    x = _placed(dtype)
    out = _maybe_jit(mr.program(clients=N)(mr.reduce_mean), jit)(x)
    floating = jnp.issubdtype(dtype, jnp.floating)
    assert out.dtype == (dtype if floating else DEFAULT_FLOAT)
    expected = np.asarray(x).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["broadcast", "reduce_sum", "reduce_mean"])
def test_eval_shape_agrees_with_real_outputs(name, dtype):
    fn = mr.program(clients=N)(getattr(mr, name))
    x = _value(dtype) if name == "broadcast" else _placed(dtype)
    abstract, real = jax.eval_shape(fn, x), jax.jit(fn)(x)
    assert (abstract.shape, abstract.dtype) == (real.shape, real.dtype)
    out_aval = jax.make_jaxpr(fn)(x).out_avals[0]
    real_aval = jax.typeof(real)
    assert (out_aval.shape, out_aval.dtype) == (real_aval.shape, real_aval.dtype)
    assert out_aval.sharding.spec == real_aval.sharding.spec


def test_primitive_names_appear_in_jaxpr_with_static_params():
    @mr.program(placements={"clients": N})
    def fn(x):
        return mr.reduce_mean(mr.broadcast(x)) + mr.reduce_sum(mr.broadcast(x))

    text = str(jax.make_jaxpr(fn)(jnp.ones(3)))
    for name in ("placed_broadcast", "placed_mean", "placed_sum"):
        assert name in text
    assert "placement=clients" in text
    assert f"size={N}" in text


@pytest.mark.parametrize(
    ("reduction", "expected"), [(mr.reduce_sum, float(N)), (mr.reduce_mean, 1.0)]
)
@pytest.mark.parametrize("jacobian", [jax.jacfwd, jax.jacrev])
def test_jacobian_of_broadcast_then_reduce(reduction, expected, jacobian):
    fn = mr.program(clients=N)(lambda x: reduction(mr.broadcast(x)))
    jac = jacobian(fn)(jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(jac), expected * np.eye(3))


def _program_of_everything(x, y):
    placed = mr.broadcast(x)
    mapped = mr.map_fn(lambda a, b: jnp.sin(a) * b + a**2, (placed, y))
    weights = mr.map_fn(lambda b: jnp.exp(b[0]), y)
    return (
        mr.reduce_mean(mapped) * mr.reduce_sum(jnp.cos(mapped)).sum()
        + mr.reduce_weighted_mean(mapped, weights) ** 2
    )


@JIT
def test_check_grads_order_two_forward_and_reverse(jit):
    fn = _maybe_jit(mr.program(clients=N)(_program_of_everything), jit)
    x = jnp.linspace(-1.0, 1.0, 3)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(N, 3)))
    check_grads(fn, (x, y), order=2, modes=["fwd", "rev"])


@pytest.mark.parametrize(
    ("primal", "dual"),
    [
        (lambda x: mr.broadcast(x).sum(), "placed_sum"),
        (lambda x: mr.reduce_sum(x * x).sum(), "placed_broadcast"),
        (lambda x: mr.reduce_mean(x * x).sum(), "placed_broadcast"),
    ],
    ids=["broadcast", "sum", "mean"],
)
def test_gradient_jaxpr_contains_dual_primitive(primal, dual):
    fn = mr.program(clients=N)(primal)
    x = jnp.ones((N, 3)) if dual == "placed_broadcast" else jnp.ones(3)
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(fn))(x))
    assert dual in grad_jaxpr


def test_symbolic_zero_cotangents_stay_symbolic():
    @mr.program(clients=N)
    def fn(x):
        unused = mr.reduce_sum(mr.broadcast(x))
        return (x * 2.0).sum(), unused

    grad = jax.grad(lambda x: fn(x)[0])(jnp.ones(3))
    np.testing.assert_allclose(np.asarray(grad), 2.0)
    text = str(jax.make_jaxpr(jax.grad(lambda x: fn(x)[0]))(jnp.ones(3)))
    assert text.count("placed_sum") == 1  # only the forward one: no transpose of a zero


@JIT
def test_vmap_of_whole_program_matches_loop(jit):
    fn = mr.program(clients=N)(_program_of_everything)
    xs = jnp.asarray(np.random.default_rng(2).normal(size=(5, 3)))
    ys = jnp.asarray(np.random.default_rng(3).normal(size=(5, N, 3)))
    batched = _maybe_jit(jax.vmap(fn), jit)(xs, ys)
    looped = jnp.stack([fn(x, y) for x, y in zip(xs, ys, strict=True)])
    assert_trees_all_close(batched, looped)


@pytest.mark.parametrize("in_axes", [0, 1, 2])
@pytest.mark.parametrize("reduction", [mr.reduce_sum, mr.reduce_mean])
def test_vmap_of_reduction_on_any_batch_axis(reduction, in_axes):
    x = jnp.asarray(np.random.default_rng(4).normal(size=(N, 3, 2)))
    batched = jnp.moveaxis(jnp.stack([x, 2 * x, 3 * x]), 0, in_axes)
    out = jax.vmap(mr.program(clients=N)(reduction), in_axes=in_axes)(batched)
    expected = jnp.stack([reduction_ref(reduction, k * x) for k in (1, 2, 3)])
    assert_trees_all_close(out, expected)


def reduction_ref(reduction, x):
    return x.sum(0) if reduction is mr.reduce_sum else x.mean(0)


def test_vmap_of_broadcast_on_inner_axis():
    xs = jnp.arange(6.0).reshape(3, 2)
    out = jax.vmap(mr.program(clients=N)(mr.broadcast), in_axes=1, out_axes=2)(xs)
    assert out.shape == (N, 3, 2)
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.asarray(xs), (N, 3, 2)))


def test_integer_mean_has_no_gradient_but_float_path_does():
    @mr.program(clients=N)
    def fn(x, counts):
        return (mr.reduce_mean(mr.broadcast(x)) * mr.reduce_mean(counts)).sum()

    grad = jax.grad(fn)(jnp.ones(3), jnp.arange(N * 3).reshape(N, 3))
    np.testing.assert_allclose(np.asarray(grad), np.arange(N * 3).reshape(N, 3).mean(0))
