"""map_fn over a value straight from broadcast: passed unbatched, with the placed value's semantics.

The reference is always the same program with the broadcast materialised by hand
(`jnp.broadcast_to`: a new object per leaf, which map_fn maps batched, as any value computed
from a placed one).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from helpers.jaxprs import live_shapes
from jax import export
from jax.extend import core as jex_core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from bridge_mr import jax_core as mr

N = 4
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
# float32: the unbatched program contracts over clients and examples in one sum, the batched one
# in two, so the gradients differ by a few ulps.
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


def _params(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(6, 8)), dtype),
        "b1": jnp.asarray(rng.normal(size=(8,)), dtype),
        "w2": jnp.asarray(rng.normal(size=(8, 2)), dtype),
    }


def _data(n=N, seed=1, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, 3, 6)), dtype),
        "y": jnp.asarray(rng.normal(size=(n, 3, 2)), dtype),
    }


def _client(w, d):
    """One client's loss of a small MLP, plus a term of the parameters alone."""
    hidden = jnp.tanh(d["x"] @ w["w1"] + w["b1"])
    return jnp.mean((hidden @ w["w2"] - d["y"]) ** 2) + jnp.sum(jnp.sin(w["b1"]))


def _materialised(w, n=N):
    """`w` placed by hand, so that map_fn maps it batched: the reference."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), w)


def _weights(d):
    return mr.map_fn(lambda d: jnp.exp(d["x"][0, 0]), d)


REDUCTIONS = {
    "none": lambda mapped, d: mapped,
    "sum": lambda mapped, d: mr.reduce_sum(mapped),
    "mean": lambda mapped, d: mr.reduce_mean(mapped),
    "weighted_mean": lambda mapped, d: mr.reduce_weighted_mean(mapped, _weights(d)),
}
REDUCTION = pytest.mark.parametrize("reduction", list(REDUCTIONS))


def _round(reduction, place, n=N):
    """broadcast (or `place`) → map_fn(_client) → the reduction, as a program of `n` clients."""

    def fn(w, d):
        return REDUCTIONS[reduction](mr.map_fn(_client, (place(w), d)), d)

    return mr.program(clients=n)(fn)


def _scalar(fn):
    return lambda w, d: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fn(w, d)))


def _derivatives(fn, w, d, jit):
    """Values and derivatives of every kind and order of `fn` at (w, d)."""
    loss = _scalar(fn)
    tangents = jax.tree.map(lambda x: jnp.cos(x) + 0.5, (w, d))
    derivatives = {
        "value": fn,
        "grad": jax.grad(loss, argnums=(0, 1)),
        "jacfwd": jax.jacfwd(fn),
        "jacrev": jax.jacrev(fn, argnums=(0, 1)),
        "hessian": jax.hessian(loss),
        "grad_of_grad": jax.grad(lambda w, d: jnp.sum(jax.grad(loss)(w, d)["w1"] ** 2)),
        "jvp": lambda w, d: jax.jvp(fn, (w, d), tangents),
    }
    return {name: _maybe_jit(f, jit)(w, d) for name, f in derivatives.items()}


# --- how to see whether a map ran batched -----------------------------------------------------


def _placed_copies(fn, args, values, n=N):
    """The leaves of `values` of which the jaxpr of `fn(*args)` computes a [n, *shape] copy."""
    shapes = set(live_shapes(jax.make_jaxpr(fn)(*args).jaxpr))
    return [v.shape for v in jax.tree.leaves(values) if (n, *v.shape) in shapes]


def _sin_shapes(fn, *args):
    """The shapes `jnp.sin` is applied at in `fn`: per client when a map runs unbatched."""

    def shapes(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sin":
                found.append(tuple(eqn.outvars[0].aval.shape))
            for sub in jex_core.jaxprs_in_params(eqn.params):
                found += shapes(sub)
        return found

    return shapes(jax.make_jaxpr(fn)(*args).jaxpr)


# --- values and derivatives -------------------------------------------------------------------


@JIT
@REDUCTION
def test_values_and_derivatives_match_the_materialised_broadcast(reduction, jit):
    w, d = _params(), _data()
    got = _derivatives(_round(reduction, mr.broadcast), w, d, jit)
    expected = _derivatives(_round(reduction, _materialised), w, d, jit)
    for name in got:
        assert_trees_all_close(got[name], expected[name], **TOL)


@pytest.mark.x64
@REDUCTION
def test_float64_derivatives_match_to_rounding(reduction):
    w, d = _params(dtype=jnp.float64), _data(dtype=jnp.float64)
    got = _derivatives(_round(reduction, mr.broadcast), w, d, jit=True)
    expected = _derivatives(_round(reduction, _materialised), w, d, jit=True)
    for name in got:
        assert_trees_all_close(got[name], expected[name], rtol=1e-12, atol=1e-12)
    check_grads(_round(reduction, mr.broadcast), (w, d), order=2, modes=["fwd", "rev"])


@JIT
def test_map_of_only_unbatched_inputs_keeps_the_placement_axis(jit):
    @mr.program(clients=N)
    def fn(w):
        placed = mr.broadcast(w)
        return mr.map_fn(lambda w: jnp.sin(w["b1"]) * 2.0, placed), mr.map_fn(
            lambda w: jax.tree.map(jnp.cos, w), placed
        )

    w = _params()
    single, tree = _maybe_jit(fn, jit)(w)
    assert single.shape == (N, 8)
    assert_trees_all_close(single, jnp.broadcast_to(jnp.sin(w["b1"]) * 2.0, (N, 8)))
    assert_trees_all_close(tree, _materialised(jax.tree.map(jnp.cos, w)))
    assert _sin_shapes(fn, w) == [(8,)]  # computed once, then repeated


@JIT
def test_mixed_leaves_of_one_argument(jit):
    # One pytree (not a tuple) holding a broadcast leaf, a per-client leaf and a modified one.
    @mr.program(clients=N)
    def fn(x, y, place):
        placed = place(x)
        arg = {"shared": placed, "own": y, "scaled": placed * 2.0}
        return mr.reduce_sum(
            mr.map_fn(lambda a: jnp.sin(a["shared"]) * a["own"] + a["scaled"], arg)
        )

    x, y = jnp.linspace(-1.0, 1.0, 3), _data()["x"][:, 0, :3]
    got = _maybe_jit(lambda x, y: fn(x, y, mr.broadcast), jit)(x, y)
    assert_trees_all_close(got, fn(x, y, _materialised), **TOL)
    assert sorted(_sin_shapes(lambda x, y: fn(x, y, mr.broadcast), x, y)) == [(3,)]


@JIT
def test_vmap_of_the_whole_program_matches_a_loop(jit):
    fn = _round("weighted_mean", mr.broadcast)
    ws = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(_params(seed) for seed in range(3)))
    ds = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(_data(seed=s) for s in range(3)))
    for in_axes, loop in [
        ((0, 0), lambda i: fn(_at(ws, i), _at(ds, i))),
        ((0, None), lambda i: fn(_at(ws, i), _data())),
        ((None, 0), lambda i: fn(_params(), _at(ds, i))),
    ]:
        w = _params() if in_axes[0] is None else ws
        d = _data() if in_axes[1] is None else ds
        batched = _maybe_jit(jax.vmap(fn, in_axes=in_axes), jit)(w, d)
        grads = _maybe_jit(jax.vmap(jax.grad(fn), in_axes=in_axes), jit)(w, d)
        looped = jnp.stack([loop(i) for i in range(3)])
        assert_trees_all_close(batched, looped, **TOL)
        for i in range(3):
            w_i = w if in_axes[0] is None else _at(ws, i)
            d_i = d if in_axes[1] is None else _at(ds, i)
            assert_trees_all_close(_at(grads, i), jax.grad(fn)(w_i, d_i), **TOL)


def _at(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


# --- what stays batched -----------------------------------------------------------------------

MODIFIED = {
    "times_two": lambda p: p * 2.0,
    "plus_zero": lambda p: p + 0.0,
    "slice": lambda p: p[:, 1:],
    "flip": lambda p: jnp.flip(p, 0),
    "stop_gradient": jax.lax.stop_gradient,
    "copy": lambda p: jnp.array(p, copy=True),
    "materialised": lambda p: jnp.broadcast_to(p[0], p.shape),
}


@pytest.mark.parametrize("modify", list(MODIFIED))
def test_a_value_modified_before_the_map_stays_batched(modify):
    @mr.program(clients=N)
    def fn(x):
        return mr.map_fn(jnp.sin, MODIFIED[modify](mr.broadcast(x)))

    x = jnp.linspace(-1.0, 1.0, 3)
    expected = jnp.sin(MODIFIED[modify](_materialised(x)))
    assert_trees_all_close(fn(x), expected)
    assert_trees_all_close(jax.jit(fn)(x), expected)
    assert _sin_shapes(fn, x) == [expected.shape]


def test_an_equal_but_distinct_array_is_mapped_batched():
    x = jnp.linspace(-1.0, 1.0, 3)
    with mr.program(clients=N):
        placed = mr.broadcast(x)
        twin = jnp.array(placed, copy=True)
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(3,)]
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, twin)) == [(N, 3)]


def test_a_broadcast_returned_from_an_inner_jit_is_a_new_value():
    x = jnp.linspace(-1.0, 1.0, 3)
    with mr.program(clients=N):
        placed = jax.jit(mr.broadcast)(x)
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(N, 3)]
        assert_trees_all_close(mr.map_fn(jnp.sin, placed), jnp.sin(_materialised(x)))


def test_a_broadcast_closed_over_by_an_inner_jit_stays_unbatched():
    x = jnp.linspace(-1.0, 1.0, 3)
    with mr.program(clients=N):
        placed = mr.broadcast(x)
        mapped = jax.jit(lambda: mr.map_fn(jnp.sin, placed))
        assert _sin_shapes(mapped) == [(3,)]
        assert_trees_all_close(mapped(), jnp.sin(_materialised(x)))


def test_a_deleted_placed_array_raises_as_when_mapped_batched():
    with mr.program(clients=N):
        placed = mr.broadcast(jnp.ones(3))
        placed.delete()
        with pytest.raises(RuntimeError, match="deleted"):
            mr.map_fn(jnp.sin, placed)


# --- the table of broadcasts: scope, lifetime, identity ---------------------------------------


def test_the_table_holds_no_input_after_its_placed_value_dies():
    with mr.program(clients=N):
        source = jnp.arange(3.0) * 2.0
        ref = weakref.ref(source)
        placed = mr.broadcast(source)
        del source
        gc.collect()
        assert ref() is not None  # held while `placed` lives, for map_fn
        del placed
        gc.collect()
        assert ref() is None


def test_the_table_is_dropped_when_the_program_ends():
    with mr.program(clients=N):
        source = jnp.arange(3.0) * 2.0
        ref = weakref.ref(source)
        placed = mr.broadcast(source)
        del source
    gc.collect()
    assert ref() is None
    with mr.program(clients=N):  # a later program: the placed value maps batched
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(N, 3)]


def test_decorated_programs_drop_their_table_per_call():
    refs = []

    @mr.program(clients=N)
    def fn(x):
        source = x * 2.0
        refs.append(weakref.ref(source))
        return mr.map_fn(jnp.sin, mr.broadcast(source))

    for _ in range(3):
        fn(jnp.ones(3))
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3


def test_a_reused_id_never_hits():
    # Broadcast many values and drop them, then map fresh arrays, which often reuse the freed
    # ids: a hit would map the zeros broadcast earlier instead of the array's own values.
    with mr.program(clients=N):
        for _ in range(64):
            placed = mr.broadcast(jnp.zeros(3))
            del placed
        for i in range(64):
            fresh = jnp.full((N, 3), float(i + 1))
            np.testing.assert_array_equal(np.asarray(mr.map_fn(lambda a: a, fresh)), i + 1)


def test_nested_programs():
    x = jnp.linspace(-1.0, 1.0, 3)
    with mr.program(clients=N):
        placed = mr.broadcast(x)
        with mr.program(clients=N):  # the same placement: the same table
            assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(3,)]
            inner = mr.broadcast(x)
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, inner)) == [(3,)]
        with mr.program(groups=N):  # another placement: its own table, mapped batched
            assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(N, 3)]
            assert_trees_all_close(mr.map_fn(jnp.sin, placed), jnp.sin(_materialised(x)))
        assert _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)) == [(3,)]


def test_threads_tracing_two_programs_at_once():
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def run(n):
        try:
            with mr.program(clients=n):
                x = jnp.linspace(-1.0, 1.0, 3) * n
                placed = mr.broadcast(x)
                barrier.wait()  # both broadcasts are recorded before either maps
                results[n] = (
                    _sin_shapes(lambda: mr.map_fn(jnp.sin, placed)),
                    mr.reduce_sum(mr.map_fn(jnp.sin, placed)),
                    x,
                )
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(n,)) for n in (3, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for n, (shapes, total, x) in results.items():
        assert shapes == [(3,)]
        assert_trees_all_close(total, n * jnp.sin(x))


# --- the FedSGD parameter gradient has no per-client copy of the parameters -------------------


def _fedsgd_loss(w, d):
    return mr.reduce_mean(mr.map_fn(_client, (mr.broadcast(w), d)))


@pytest.mark.parametrize("mesh", ["none", "auto", "explicit"])
@pytest.mark.parametrize("wrap", ["plain", "jit"])
def test_fedsgd_gradient_has_no_per_client_parameters(wrap, mesh):
    w, d = _params(), _data()
    grad = jax.grad(mr.program(clients=N)(_fedsgd_loss))
    grad = jax.jit(grad) if wrap == "jit" else grad
    with MESHES[mesh]():
        assert _placed_copies(grad, (w, d), w) == []
        # The reference materialises the parameters, so the check does see such copies.
        reference = mr.program(clients=N)(
            lambda w, d: mr.reduce_mean(mr.map_fn(_client, (_materialised(w), d)))
        )
        assert len(_placed_copies(jax.grad(reference), (w, d), w)) == 3


# --- meshes -----------------------------------------------------------------------------------


def _mesh(axis_type):
    return jax.make_mesh((4, 2), ("clients", "model"), axis_types=(axis_type,) * 2)


MESHES = {
    "none": contextlib.nullcontext,
    "auto": lambda: jax.set_mesh(_mesh(AxisType.Auto)),
    "explicit": lambda: jax.set_mesh(_mesh(AxisType.Explicit)),
}


def _model_sharded(w, mesh):
    """w1 and b1 split along "model" (their output features), w2 replicated."""
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P()}
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in w.items()}


@JIT
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_meshes_keep_placement_and_model_shardings(axis_type, jit):
    w, d = _params(), _data()
    seen = []

    def client(w, d):
        seen.append(jax.typeof(w["w1"]).sharding.spec)
        return _client(w, d)

    @mr.program(clients=N)
    def fn(w, d):
        placed = mr.broadcast(w)
        losses = mr.map_fn(client, (placed, d))
        return losses, mr.map_fn(lambda w: w["w1"] * 2.0, placed), mr.reduce_mean(losses)

    grad = jax.grad(lambda w, d: fn(w, d)[2], argnums=(0, 1))
    expected = fn(w, d), grad(w, d)
    seen.clear()
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        w = _model_sharded(w, mesh)
        (losses, repeated, loss), grads = _maybe_jit(fn, jit)(w, d), _maybe_jit(grad, jit)(w, d)
    assert_trees_all_close(((losses, repeated, loss), grads), expected, **TOL)
    for placed in (losses, repeated, grads[1]["x"]):
        assert placed.sharding.spec[0] == "clients"
    assert repeated.sharding.is_equivalent_to(NamedSharding(mesh, P("clients", None, "model")), 3)
    if axis_type == AxisType.Explicit:
        assert set(seen) == {P(None, "model")}  # fn sees the parameters as they were sharded
        assert jax.typeof(grads[0]["w1"]).sharding.spec == P(None, "model")


def test_gradients_with_an_explicit_mesh_argument():
    # No ambient mesh: the unbatched parameters are typed on the mesh, as a slice of the placed
    # value would be, so the transpose may sum the clients' contributions into them.
    mesh = _mesh(AxisType.Explicit)

    def loss(w, d, mesh=None):
        return mr.reduce_mean(mr.map_fn(_client, (mr.broadcast(w, mesh=mesh), d), mesh=mesh))

    w, d = _params(), _data()
    expected = jax.grad(mr.program(clients=N)(loss), argnums=(0, 1))(w, d)
    grad = jax.grad(mr.program(clients=N)(lambda w, d: loss(w, d, mesh)), argnums=(0, 1))
    jax.make_jaxpr(grad)(w, d)  # inputs typed on no mesh (as the torch runner's are) trace
    got = jax.jit(grad)(*jax.device_put((w, d), NamedSharding(mesh, P())))
    assert_trees_all_close(got, expected, **TOL)


@pytest.mark.parametrize("mesh", ["none", "auto", "explicit"])
def test_every_reduction_on_every_mesh(mesh):
    w, d = _params(), _data()
    for reduction in REDUCTIONS:
        fn, reference = _round(reduction, mr.broadcast), _round(reduction, _materialised)
        expected = reference(w, d), jax.grad(_scalar(reference), argnums=(0, 1))(w, d)
        with MESHES[mesh]():
            got = jax.jit(fn)(w, d), jax.jit(jax.grad(_scalar(fn), argnums=(0, 1)))(w, d)
        assert_trees_all_close(got, expected, **TOL)


# --- symbolic placement sizes -----------------------------------------------------------------


def _symbolic_round(w, d):
    placed = mr.broadcast(w)
    repeated = mr.map_fn(lambda w: w["b1"] * 2.0, placed)  # no per-client input at all
    loss = mr.reduce_mean(mr.map_fn(_client, (placed, d)))
    return repeated, loss, jax.grad(_fedsgd_loss, argnums=(0, 1))(w, d)


@pytest.mark.parametrize("mesh", ["none", "auto"])
def test_exported_with_a_symbolic_client_count(mesh):
    (n,) = export.symbolic_shape("n")
    specs = (
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params()),
        {
            "x": jax.ShapeDtypeStruct((n, 3, 6), jnp.float32),
            "y": jax.ShapeDtypeStruct((n, 3, 2), jnp.float32),
        },
    )
    with MESHES[mesh]():
        exported = export.export(jax.jit(mr.program(clients=n)(_symbolic_round)))(*specs)
        for count in (1, 3):
            w, d = _params(), _data(count)
            expected = jax.jit(mr.program(clients=count)(_symbolic_round))(w, d)
            got = exported.call(w, d)
            assert got[0].shape == (count, 8)
            assert_trees_all_close(got, expected, **TOL)
