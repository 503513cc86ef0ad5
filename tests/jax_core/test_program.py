"""`program`: decorator and context manager, thread safety, and the errors of the API."""

from __future__ import annotations

import functools
import threading
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax.sharding import AxisType

from bridge_mr import jax_core as mr


def test_context_manager_and_decorator_agree():
    x = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}

    @mr.program(placements={"clients": 3})
    def decorated(x):
        return mr.reduce_sum(mr.broadcast(x))

    with mr.program(placements={"clients": 3}) as placement:
        managed = mr.reduce_sum(mr.broadcast(x))
    assert placement == mr.Placement("clients", 3)
    assert_trees_all_close(decorated(x), managed)
    assert_trees_all_close(managed, jax.tree.map(lambda v: 3 * v, x))


def test_placement_is_restored_after_exit_and_nesting():
    assert mr.current_placement() is None
    with mr.program(clients=2):
        with mr.program(placements={"silos": 5}):
            assert mr.current_placement() == mr.Placement("silos", 5)
        assert mr.current_placement() == mr.Placement("clients", 2)
    assert mr.current_placement() is None


def test_placement_is_restored_when_the_body_raises():
    fn = mr.program(clients=2)(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fn()
    assert mr.current_placement() is None


def test_pytrees_with_namedtuples_lists_and_none():
    Pair = namedtuple("Pair", ["a", "b"])
    tree = {"pair": Pair(jnp.ones(2), [jnp.zeros(3), None]), "n": jnp.asarray(3)}

    @jax.jit
    @mr.program(clients=4)
    def fn(tree):
        placed = mr.broadcast(tree)
        return placed, mr.reduce_mean(placed), mr.map_fn(lambda t: t, placed)

    placed, mean, mapped = fn(tree)
    assert isinstance(placed["pair"], Pair)
    assert placed["pair"].b[1] is None
    assert placed["n"].shape == (4,)
    assert_trees_all_close(mean, tree)
    assert_trees_all_close(mapped, placed)


def test_map_fn_unpacks_a_tuple_argument():
    with mr.program(clients=3):
        out = mr.map_fn(lambda a, b: a * b, (jnp.ones((3, 2)), jnp.arange(6.0).reshape(3, 2)))
    assert_trees_all_close(out, jnp.arange(6.0).reshape(3, 2))


def test_weighted_mean_with_one_weight_vector_and_with_a_weight_tree():
    x = {"a": jnp.arange(8.0).reshape(4, 2), "b": jnp.arange(4.0)}
    w = jnp.asarray([1.0, 0.0, 0.0, 3.0])
    with mr.program(clients=4):
        single = mr.reduce_weighted_mean(x, w)
        tree = mr.reduce_weighted_mean(x, {"a": jnp.ones((4, 2)), "b": w})
    expected_a = (np.arange(8.0).reshape(4, 2) * w[:, None]).sum(0) / 4.0
    assert_trees_all_close(single, {"a": expected_a, "b": 9.0 / 4.0})
    assert_trees_all_close(tree, {"a": np.arange(8.0).reshape(4, 2).mean(0), "b": 9.0 / 4.0})


def test_two_threads_with_different_placements_match_sequential_runs():
    def make(n):
        @jax.jit
        @mr.program(clients=n)
        def fn(x):
            return mr.reduce_mean(mr.map_fn(lambda v: jnp.sin(v) * n, mr.broadcast(x)))

        return fn

    runs = {n: make(n) for n in (3, 7)}
    expected = {n: np.asarray(fn(jnp.arange(4.0))) for n, fn in runs.items()}
    results: dict[int, list[np.ndarray]] = {3: [], 7: []}
    barrier = threading.Barrier(2)

    def worker(n):
        barrier.wait()
        for step in range(20):
            # A fresh trace every few steps so both threads trace concurrently.
            fn = make(n) if step % 5 == 0 else runs[n]
            results[n].append(np.asarray(fn(jnp.arange(4.0))))

    threads = [threading.Thread(target=worker, args=(n,)) for n in (3, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n in (3, 7):
        assert len(results[n]) == 20
        for result in results[n]:
            np.testing.assert_array_equal(result, expected[n])


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: mr.broadcast(jnp.ones(2)),
        lambda: mr.map_fn(jnp.sin, jnp.ones((2, 2))),
        lambda: mr.reduce_sum(jnp.ones(2)),
        lambda: mr.reduce_mean(jnp.ones(2)),
        lambda: mr.reduce_weighted_mean(jnp.ones(2), jnp.ones(2)),
    ],
    ids=["broadcast", "map_fn", "reduce_sum", "reduce_mean", "reduce_weighted_mean"],
)
def test_calls_outside_any_program_explain_the_fix(call):
    with pytest.raises(RuntimeError, match=r"outside any program.*program\(placements="):
        call()


@pytest.mark.parametrize(
    ("placements", "error", "match"),
    [
        ({}, ValueError, "exactly one placement.*got 0 entries"),
        ({"clients": 2, "servers": 1}, ValueError, "exactly one placement.*got 2 entries"),
        ({3: 2}, TypeError, "non-empty str.*got int: 3"),
        ({"": 2}, TypeError, "non-empty str"),
        ({"clients": 0}, ValueError, "positive int.*got int: 0"),
        ({"clients": -1}, ValueError, "positive int"),
        ({"clients": 2.5}, ValueError, "positive int.*got float: 2.5"),
        ({"clients": True}, ValueError, "positive int.*got bool"),
        ({"clients": "3"}, ValueError, "positive int.*symbolic dimension; got str: '3'"),
        ([("clients", 2)], TypeError, "expects a mapping.*got list"),
    ],
)
def test_bad_placements(placements, error, match):
    with pytest.raises(error, match=match):
        mr.program(placements=placements)


def test_numpy_int_size_is_accepted():
    assert mr.program(placements={"clients": np.int64(3)}).placement.size == 3


def test_placements_and_keyword_together_are_refused():
    with pytest.raises(TypeError, match="not both"):
        mr.program(placements={"clients": 2}, silos=3)


def test_map_fn_leading_dims_disagree_with_each_other():
    with (
        mr.program(clients=3),
        pytest.raises(ValueError, match=r"map_fn\(arg\)\[1\]: .*size 3; got leading dimension 4"),
    ):
        mr.map_fn(lambda a, b: a, (jnp.ones((3, 2)), jnp.ones((4, 2))))


def test_map_fn_leading_dim_disagrees_with_placement_size():
    with (
        mr.program(clients=3),
        pytest.raises(ValueError, match=r"map_fn\(arg\)\['x'\].*leading dimension 5"),
    ):
        mr.map_fn(lambda t: t, {"x": jnp.ones((5, 2))})


@pytest.mark.parametrize("reduction", [mr.reduce_sum, mr.reduce_mean])
def test_reduction_of_a_0d_value(reduction):
    with mr.program(clients=3), pytest.raises(ValueError, match="got a 0-d value"):
        reduction({"loss": jnp.asarray(1.0)})


def test_weights_with_mismatched_structure():
    with mr.program(clients=2), pytest.raises(ValueError, match="structure of x"):
        mr.reduce_weighted_mean({"a": jnp.ones((2, 3)), "b": jnp.ones(2)}, [jnp.ones(2)] * 3)


def test_weights_with_wrong_leading_dim():
    with mr.program(clients=2), pytest.raises(ValueError, match=r"reduce_weighted_mean\(w\)"):
        mr.reduce_weighted_mean(jnp.ones((2, 3)), jnp.ones(5))


def test_non_callable_fn():
    with mr.program(clients=2), pytest.raises(TypeError, match=r"fn must be callable.*got int"):
        mr.map_fn(3, jnp.ones((2, 2)))


def test_non_callable_decoratee():
    with pytest.raises(TypeError, match="decorates a callable"):
        mr.program(clients=2)(42)


_UNEVEN_CALLS = {
    "broadcast": lambda mesh: mr.broadcast(jnp.ones(2)),
    "broadcast_mesh_argument": lambda mesh: mr.broadcast(jnp.ones(2), mesh=mesh),
    "map_fn": lambda mesh: mr.map_fn(jnp.sin, jnp.ones((6, 2))),
    "map_fn_mesh_argument": lambda mesh: mr.map_fn(jnp.sin, jnp.ones((6, 2)), mesh=mesh),
    "reduce_sum": lambda mesh: mr.reduce_sum(jnp.ones((6, 2))),
    "reduce_mean": lambda mesh: mr.reduce_mean(jnp.ones((6, 2))),
    "reduce_weighted_mean": lambda mesh: mr.reduce_weighted_mean(jnp.ones((6, 2)), jnp.ones(6)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "axis_types",
    [(AxisType.Explicit, AxisType.Explicit), (AxisType.Explicit, AxisType.Auto)],
    ids=["explicit", "clients_explicit_d_auto"],
)
@pytest.mark.parametrize("name", list(_UNEVEN_CALLS))
def test_explicit_placement_axis_that_does_not_divide_the_placement_size(name, axis_types, jit):
    mesh = jax.make_mesh((4, 2), ("clients", "d"), axis_types=axis_types)
    caller = name.removesuffix("_mesh_argument")
    source = (
        rf"the mesh passed as {caller}\(mesh=\.\.\.\)"
        if name.endswith("_mesh_argument")
        else r"the mesh set with jax\.set_mesh \(or `with mesh:`\)"
    )
    fn = mr.program(clients=6)(functools.partial(_UNEVEN_CALLS[name], mesh))
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            ValueError,
            match=(
                rf"bridge_mr\.{caller}: placement 'clients' has size 6, which the Explicit axis "
                rf"'clients' of size 4 of {source} does not divide .*divisible by 4 \(e\.g\. pad "
                r"with zero-weight clients up to 8\), a mesh whose 'clients' axis size divides 6, "
                r"or make that axis Auto"
            ),
        ),
    ):
        (jax.jit(fn) if jit else fn)()


def test_mesh_argument_of_the_wrong_type():
    with mr.program(clients=2), pytest.raises(TypeError, match=r"broadcast\(mesh=...\).*got str"):
        mr.broadcast(jnp.ones(2), mesh="clients")


def test_non_array_leaf_names_its_path():
    with mr.program(clients=2), pytest.raises(TypeError, match=r"broadcast\(x\)\['bad'\]"):
        mr.broadcast({"bad": object()})
