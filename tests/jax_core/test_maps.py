"""`program(keep_maps=True)`: each `map_fn` is one `placed_map` holding its per-client function.

The program computes what it computes with maps inlined as vmap: values, gradients of both
orders, vmap of the program, symbolic zeros, closures over the enclosing trace, per-client loops
and custom rules, with and without jit, with symbolic sizes and under meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax.sharding import AxisType
from jax.test_util import check_grads

from bridge_mr import jax_core as mr

N = 4
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


def _both(fn, n=N):
    """`fn` as a program with maps inlined (vmap) and with maps kept."""
    return mr.program(clients=n)(fn), mr.program(clients=n, keep_maps=True)(fn)


def _primitives(fn, *args):
    return [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def _round(x, y):
    placed = mr.broadcast(x)
    mapped = mr.map_fn(lambda a, b: jnp.sin(a) * b + a**2, (placed, y))
    weights = mr.map_fn(lambda b: jnp.exp(b[0]), y)
    return (
        mr.reduce_mean(mapped) * mr.reduce_sum(jnp.cos(mapped)).sum()
        + mr.reduce_weighted_mean(mapped, weights) ** 2
    ).sum()


def _inputs(n=N, seed=1, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jnp.linspace(-1.0, 1.0, 3, dtype=dtype), jnp.asarray(rng.normal(size=(n, 3)), dtype)


def test_each_map_fn_is_one_placed_map_holding_one_clients_function():
    inlined, kept = _both(_round)
    x, y = _inputs()
    assert "placed_map" not in _primitives(inlined, x, y)
    eqns = [e for e in jax.make_jaxpr(kept)(x, y).jaxpr.eqns if e.primitive is mr.map_p]
    assert len(eqns) == 2
    first = eqns[0]
    # A broadcast value enters unbatched (its source, as vmap's in_axes=None), the data placed.
    assert first.params["batched"] == (False, True)
    assert [v.aval.shape for v in first.params["body"].jaxpr.invars] == [(3,), (3,)]
    assert [v.aval.shape for v in first.outvars] == [(N, 3)]
    assert (first.params["placement"], first.params["size"]) == ("clients", N)


@JIT
def test_values_and_gradients_equal_the_inlined_maps(jit):
    inlined, kept = _both(_round)
    x, y = _inputs()
    assert_trees_all_close(_maybe_jit(kept, jit)(x, y), inlined(x, y))
    grad = jax.grad(kept, argnums=(0, 1))
    assert_trees_all_close(_maybe_jit(grad, jit)(x, y), jax.grad(inlined, argnums=(0, 1))(x, y))


@pytest.mark.x64  # Finite differences of float32 values are too coarse at order two.
@JIT
def test_check_grads_order_two_forward_and_reverse(jit):
    _, kept = _both(_round)
    check_grads(_maybe_jit(kept, jit), _inputs(dtype=jnp.float64), order=2, modes=["fwd", "rev"])


@JIT
def test_second_order_derivatives_equal_the_inlined_maps(jit):
    inlined, kept = _both(_round)
    x, y = _inputs()
    hessian = _maybe_jit(jax.hessian(kept, argnums=(0, 1)), jit)(x, y)
    assert_trees_all_close(hessian, jax.hessian(inlined, argnums=(0, 1))(x, y))

    def jvp_of_vjp(fn):
        def run(a, b):
            return jax.jvp(lambda a, b: jax.vjp(fn, a, b)[1](jnp.float32(1.3)), (a, b), (a, b))

        return run

    assert_trees_all_close(_maybe_jit(jvp_of_vjp(kept), jit)(x, y), jvp_of_vjp(inlined)(x, y))


def test_gradients_are_maps_and_reductions_again():
    _, kept = _both(_round)
    names = set(_primitives(jax.grad(kept), *_inputs()))
    assert {"placed_map", "placed_sum", "placed_broadcast"} <= names
    # The unbatched-input rule: a cotangent of a value every client reads whole is summed.
    with mr.program(clients=N, keep_maps=True):
        shared = jax.grad(lambda w, y: mr.reduce_sum(mr.map_fn(lambda b: w * b, y)).sum())
        text = str(jax.make_jaxpr(shared)(jnp.float32(2.0), _inputs()[1]))
    assert "placed_sum" in text


@JIT
@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_of_the_program_equals_a_loop(in_axes, jit):
    inlined, kept = _both(_round)
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(5, N, 3)), jnp.float32)
    batched = _maybe_jit(jax.vmap(kept, in_axes=(0, in_axes)), jit)(
        xs, jnp.moveaxis(ys, 0, in_axes)
    )
    looped = jnp.stack([inlined(x, y) for x, y in zip(xs, ys, strict=True)])
    assert_trees_all_close(batched, looped)


def _with_integers(x, counts):
    """A map with an integer input and an integer result beside the float ones."""
    scaled, bumped = mr.map_fn(
        lambda a, c: (a * c.astype(a.dtype), c + 1), (mr.broadcast(x), counts)
    )
    return mr.reduce_sum(scaled).sum() * mr.reduce_mean(bumped)


@JIT
def test_integer_inputs_and_results_stay_symbolic_zeros(jit):
    inlined, kept = _both(_with_integers)
    x, counts = jnp.arange(3.0), jnp.arange(N, dtype=jnp.int32)
    grad = _maybe_jit(jax.grad(kept), jit)(x, counts)
    assert_trees_all_close(grad, jax.grad(inlined)(x, counts))
    primal, tangent = jax.jvp(lambda v: kept(v, counts), (x,), (jnp.ones(3),))
    expected = jax.jvp(lambda v: inlined(v, counts), (x,), (jnp.ones(3),))
    assert_trees_all_close((primal, tangent), expected)
    tangent_maps = [
        e for e in jax.make_jaxpr(jax.grad(kept))(x, counts).jaxpr.eqns if e.primitive is mr.map_p
    ]
    for eqn in tangent_maps:
        assert all(v.aval.dtype != jax.dtypes.float0 for v in eqn.outvars)


@JIT
def test_closures_over_the_enclosing_trace_are_unbatched_inputs(jit):
    def local_step(server, data, lr, steps):
        def client(w, b):
            rate = lr * steps.astype(lr.dtype)
            return jax.lax.fori_loop(0, 3, lambda _, v: v - rate * jnp.tanh(v * b), w)

        return mr.reduce_mean(mr.map_fn(client, (mr.broadcast(server), data))).sum()

    inlined, kept = _both(local_step)
    x, y = _inputs()
    lr, steps = jnp.float32(0.3), jnp.int32(3)
    assert_trees_all_close(_maybe_jit(kept, jit)(x, y, lr, steps), inlined(x, y, lr, steps))
    grad = jax.grad(kept, argnums=(0, 2))
    expected = jax.grad(inlined, argnums=(0, 2))(x, y, lr, steps)
    assert_trees_all_close(_maybe_jit(grad, jit)(x, y, lr, steps), expected)


@jax.custom_vjp
def _clipped_square(v):
    return v**2


def _clipped_square_fwd(v):
    return v**2, v


def _clipped_square_bwd(v, ct):
    return (jnp.clip(2 * v * ct, -0.5, 0.5),)


_clipped_square.defvjp(_clipped_square_fwd, _clipped_square_bwd)


@JIT
def test_while_loops_custom_vjp_and_checkpoint_inside_the_map(jit):
    def client(w, b):
        halvings = jax.lax.while_loop(lambda c: c[0] > 0.1, lambda c: (c[0] / 2, c[1] + 1), (b, 0))
        return jax.checkpoint(lambda v: jnp.sin(_clipped_square(v * b)))(w).sum(), halvings[1]

    def fn(x, y):
        losses, steps = mr.map_fn(client, (mr.broadcast(x), y))
        return mr.reduce_mean(losses), mr.reduce_sum(steps)

    inlined, kept = _both(fn)
    x = jnp.linspace(0.5, 1.5, 3)
    y = jnp.asarray([0.2, 3.0, 50.0, 0.05], jnp.float32)  # one scale per client
    assert_trees_all_close(_maybe_jit(kept, jit)(x, y), inlined(x, y))
    per_client = mr.program(clients=N, keep_maps=True)(
        lambda x, y: mr.map_fn(client, (mr.broadcast(x), y))[1]
    )(x, y)
    assert len(set(np.asarray(per_client).tolist())) > 1  # each client its own trip count
    loss = lambda x, y: fn(x, y)[0]
    kept_grad = mr.program(clients=N, keep_maps=True)(jax.grad(loss))
    assert_trees_all_close(
        _maybe_jit(kept_grad, jit)(x, y), mr.program(clients=N)(jax.grad(loss))(x, y)
    )


def test_one_export_for_every_client_count():
    (n,) = jax.export.symbolic_shape("n")

    def fn(x, y):
        return jax.value_and_grad(_round)(x, y)

    kept = jax.jit(mr.program(clients=n, keep_maps=True)(fn))
    exported = jax.export.export(kept)(
        jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((n, 3), jnp.float32)
    )
    for count in (2, 5):
        x, y = _inputs(count, seed=count)
        assert_trees_all_close(exported.call(x, y), mr.program(clients=count)(fn)(x, y))


def _per_client_convolution(images, kernels):
    def client(image, kernel):
        dims = ("NHWC", "HWIO", "NHWC")
        out = jax.lax.conv_general_dilated(image, kernel, (1, 1), "SAME", dimension_numbers=dims)
        return jnp.sum(jnp.tanh(out))

    return mr.reduce_mean(mr.map_fn(client, (images, kernels)))


def test_a_symbolic_client_count_runs_per_client_convolutions_as_a_loop():
    # vmap would make them one convolution grouped by the symbolic n, which XLA cannot compile.
    (n,) = jax.export.symbolic_shape("n")
    kept = jax.jit(
        mr.program(clients=n, keep_maps=True)(jax.value_and_grad(_per_client_convolution, 1))
    )
    exported = jax.export.export(kept)(
        jax.ShapeDtypeStruct((n, 2, 5, 5, 1), jnp.float32),
        jax.ShapeDtypeStruct((n, 3, 3, 1, 2), jnp.float32),
    )
    rng = np.random.default_rng(4)
    for count in (1, 3):
        images = rng.normal(size=(count, 2, 5, 5, 1)).astype(np.float32)
        kernels = rng.normal(size=(count, 3, 3, 1, 2)).astype(np.float32)
        inlined = mr.program(clients=count)(jax.value_and_grad(_per_client_convolution, 1))
        assert_trees_all_close(exported.call(images, kernels), inlined(images, kernels))


@JIT
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_under_a_mesh_the_map_stays_a_vmap(axis_type, jit):
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(axis_type,))
    x, y = _inputs(8)
    inlined, kept = _both(_round, n=8)
    with jax.set_mesh(mesh):
        assert "placed_map" not in _primitives(kept, x, y)
        got = _maybe_jit(kept, jit)(x, y)
    assert_trees_all_close(got, inlined(x, y))


def test_an_inner_program_of_the_same_placement_inherits_it():
    @mr.program(clients=N, keep_maps=True)
    def outer(y):
        return mr.program(clients=N)(lambda v: mr.map_fn(jnp.sin, v))(y)

    assert "placed_map" in _primitives(outer, _inputs()[1])


def test_keep_maps_must_be_a_bool():
    with pytest.raises(TypeError, match=r"keep_maps=\.\.\.\) expects a bool; got str: 'yes'"):
        mr.program(clients=N, keep_maps="yes")
    assert repr(mr.program(clients=N, keep_maps=True)) == (
        "program(placements={'clients': 4}, keep_maps=True)"
    )
