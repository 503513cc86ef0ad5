"""Torch-level broadcast, map_fn and reductions: gradients, torch references, JAX fallthrough."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_mr import jax_core
from bridge_mr.torch_api import broadcast, map_fn, reduce_mean, reduce_sum, reduce_weighted_mean

F64 = torch.float64
N = 3


def _placed(*shape):
    return torch.randn(N, *shape, dtype=F64, requires_grad=True)


CASES = {
    "broadcast": (lambda x: broadcast(x), lambda: (torch.randn(2, dtype=F64, requires_grad=True),)),
    "map_fn": (lambda x: map_fn(lambda v: jnp.sin(v) * v.sum(), x), lambda: (_placed(2),)),
    "map_fn_tuple": (lambda x, y: map_fn(lambda a, b: a * b, (x, y)), lambda: (_placed(2),) * 2),
    "reduce_sum": (lambda x: reduce_sum(x), lambda: (_placed(2),)),
    "reduce_mean": (lambda x: reduce_mean(x), lambda: (_placed(2),)),
    "reduce_weighted_mean": (
        lambda x, w: reduce_weighted_mean(x, w),
        lambda: (_placed(2), torch.rand(N, dtype=F64).add(0.5).requires_grad_()),
    ),
}


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck_and_gradgradcheck(name):
    fn, make_inputs = CASES[name]
    inputs = make_inputs()
    with jax_core.program(placements={"clients": N}):
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_values_match_torch_on_a_pytree():
    tree = {"a": torch.randn(2, 3), "b": [torch.randn(4)]}
    weights = torch.rand(N) + 0.5
    with jax_core.program(placements={"clients": N}):
        placed = broadcast(tree)
        assert_trees_all_close(placed, jax.tree.map(lambda t: t.expand(N, *t.shape), tree))
        doubled = map_fn(lambda t: jax.tree.map(lambda v: 2 * v, t), placed)
        assert_trees_all_close(reduce_sum(doubled), jax.tree.map(lambda t: 2 * N * t, tree))
        assert_trees_all_close(reduce_mean(doubled), jax.tree.map(lambda t: 2 * t, tree))
        assert_trees_all_close(
            reduce_weighted_mean(doubled, weights), jax.tree.map(lambda t: 2 * t, tree), rtol=1e-5
        )


def test_without_torch_tensors_the_jax_functions_run():
    with jax_core.program(placements={"clients": N}):
        placed = broadcast({"x": jnp.ones(2)})
        assert isinstance(placed["x"], jax.Array)
        assert placed["x"].shape == (N, 2)
        assert isinstance(reduce_mean(map_fn(lambda v: v["x"] * 2, placed)), jax.Array)


def test_runs_under_the_active_program_and_retraces_per_placement():
    x = torch.randn(2)
    for n in (2, 5, 2):
        with jax_core.program(placements={"clients": n}):
            assert broadcast(x).shape == (n, 2)
    with pytest.raises(RuntimeError, match="outside any program"):
        broadcast(x)


@st.composite
def _placed_trees(draw):
    n = draw(st.integers(1, 4))
    shapes = draw(
        st.dictionaries(
            st.sampled_from("abcd"), st.lists(st.integers(1, 3), max_size=2), min_size=1
        )
    )
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    tree = {k: torch.randn(n, *s, generator=gen) for k, s in shapes.items()}
    weights = torch.rand(n, generator=gen) + 0.1
    return n, tree, weights


@settings(max_examples=10, deadline=None)
@given(_placed_trees())
def test_reductions_equal_torch_on_random_pytrees(case):
    n, tree, weights = case
    with jax_core.program(placements={"clients": n}):
        # float32 sums of up to 4 terms of magnitude <= ~4: a few ulps apart at most.
        close = {"rtol": 1e-5, "atol": 1e-6}
        assert_trees_all_close(reduce_sum(tree), {k: v.sum(0) for k, v in tree.items()}, **close)
        assert_trees_all_close(reduce_mean(tree), {k: v.mean(0) for k, v in tree.items()}, **close)
        want = {
            k: (v * weights.reshape(-1, *[1] * (v.ndim - 1))).sum(0) / weights.sum()
            for k, v in tree.items()
        }
        assert_trees_all_close(reduce_weighted_mean(tree, weights), want, **close)
