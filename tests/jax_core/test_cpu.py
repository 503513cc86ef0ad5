"""XLA:CPU options per program (`cpu_compiler_options`) and two-level float sums
(`accurate_sums`, `cpu_program`).

Accuracy is measured against float64 numpy; the rewritten sums are compiled without YNNPACK's
fusions (where bridge_mr uses them), where XLA:CPU sums in one sequential accumulator.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from bridge_mr import jax_core as mr

OPTION = "xla_cpu_experimental_ynn_fusion_type"
NO_YNN = {OPTION: ""}
NO_REDUCE = {OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _steps(reduce_axis):
    """A scan over steps whose body sums each step's slice over `reduce_axis`."""

    def run(xs):
        body = lambda carry, x: (carry + x.sum(axis=reduce_axis).sum(), None)
        return lax.scan(body, jnp.zeros((), xs.dtype), xs)[0]

    return run


def _client_steps(x):
    """One client's local steps: each step sums its batch of [32, 512] over the batch."""
    return _steps(0)(x.reshape(2, 32, 512))


WIDE_XS = (3, 8, 64, 64)  # 3 steps of 8 arrays of 64 x 64


@pytest.mark.parametrize(
    ("program", "shape", "expected"),
    [
        (_steps(0), WIDE_XS, NO_REDUCE),  # 8 arrays of 4,096 added elementwise, in a loop
        (_steps((0, 1)), (3, 64, 64, 8), {}),  # 4,096 values into each of 8 results
        (lambda xs: xs.sum(axis=1), WIDE_XS, {}),  # wide, outside any loop
        (
            lambda xs: lax.fori_loop(0, 2, lambda i, c: c + xs[i].sum(0).sum(), 0.0),
            WIDE_XS,
            NO_REDUCE,
        ),
        # vmap of a scan of steps: each client's batch sum, [8, 32, 512] over the batch axis.
        (jax.vmap(_client_steps), (8, 2 * 32 * 512), NO_REDUCE),
        (_client_steps, (2 * 32 * 512,), {}),  # one client: 512 results
        (lambda xs: _steps(0)(xs.astype(jnp.int32)).astype(jnp.float32), WIDE_XS, {}),
    ],
    ids=["wide", "narrow", "outside", "while", "vmap", "one_client", "int"],
)
def test_options_turn_the_reduce_fusion_off_for_wide_sums_in_loops(program, shape, expected):
    xs = jnp.ones(shape)
    assert mr.cpu_compiler_options(jax.make_jaxpr(program)(xs)) == expected


def test_a_convolution_turns_every_ynn_fusion_off_even_beside_a_wide_sum_in_a_loop():
    def program(w, xs):
        h = lax.conv(xs[0][None], w, window_strides=(1, 1), padding="SAME")
        return h.sum() + _steps(0)(xs)

    jaxpr = jax.make_jaxpr(program)(jnp.ones((2, 8, 3, 3)), jnp.ones(WIDE_XS))
    assert mr.cpu_compiler_options(jaxpr) == NO_YNN


def test_this_jaxlib_compiles_the_no_reduce_option_and_it_keeps_sums_out_of_ynnpack():
    # Pins the enum name (an unknown one fails the compile) and what it does: jaxlib's default
    # hands this reduction to YNNPACK, the option does not.
    lowered = jax.jit(lambda x: (x * x).sum(axis=(0, 2))).lower(jnp.ones((8, 8, 900)))
    assert "__ynn_fusion" in lowered.compile().as_text()
    assert "__ynn_fusion" not in lowered.compile(NO_REDUCE).as_text()


def _relative_error(got, x, axes):
    want = np.asarray(x, np.float64).sum(axis=axes)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.abs(want)))


def test_accurate_sums_are_as_accurate_without_ynn_fusions_as_jaxlib_default_sums():
    # BatchNorm's per-channel sum over (N, H, W) of an [8, 8, 30, 30] batch: 7,200 values.
    x = np.random.default_rng(0).normal(1.0, 2.0, (8, 8, 30, 30)).astype(np.float32)
    axes = (0, 2, 3)
    total = lambda x: x.sum(axis=axes)
    plain = jax.jit(total).lower(x)
    blocked = jax.jit(mr.accurate_sums(total)).lower(x)
    default = _relative_error(plain.compile()(x), x, axes)  # YNNPACK's reduce fusion
    sequential = _relative_error(plain.compile(NO_YNN)(x), x, axes)
    rewritten = _relative_error(blocked.compile(NO_YNN)(x), x, axes)
    assert sequential > 5 * default, "the check can see the sequential accumulator"
    assert rewritten <= 2 * default, (rewritten, default, sequential)
    assert rewritten <= 4 * float(np.finfo(np.float32).eps)


def test_accurate_sums_rewrite_sums_in_loop_bodies_and_in_gradients():
    xs = jnp.linspace(0.1, 1.0, 3 * 16 * 64).reshape(3, 16, 64)

    def loss(w):
        body = lambda c, x: (c + jnp.tanh(x * w).sum(), None)  # 1,024 values per step
        return lax.scan(body, 0.0, xs)[0]

    program = mr.accurate_sums(jax.value_and_grad(loss))
    text = str(jax.make_jaxpr(program)(0.5))
    assert text.count("optimization_barrier") >= 2  # forward's sum and the gradient's
    got = jax.jit(program)(0.5)
    np.testing.assert_allclose(got, jax.value_and_grad(loss)(0.5), rtol=2e-6)
    # Transformations of the rewritten function compose as usual.
    np.testing.assert_allclose(jax.grad(mr.accurate_sums(loss))(0.5), got[1], rtol=2e-6)
    np.testing.assert_allclose(
        jax.vmap(mr.accurate_sums(loss))(jnp.ones(2)), loss(1.0) * jnp.ones(2), rtol=2e-6
    )


@pytest.mark.parametrize(
    ("shape", "axes", "dtype"),
    [
        ((8, 8), (0, 1), jnp.float32),  # 64 values: too few to rewrite
        ((1031,), (0,), jnp.float32),  # a prime count on one axis: nothing to split
        ((64, 64), (0, 1), jnp.int32),
    ],
)
def test_accurate_sums_leave_small_prime_and_integer_sums_as_they_are(shape, axes, dtype):
    x = jnp.ones(shape, dtype)
    assert "optimization_barrier" not in str(
        jax.make_jaxpr(mr.accurate_sums(lambda x: x.sum(axis=axes)))(x)
    )


@pytest.mark.x64
def test_accurate_sums_leave_float64_sums_as_they_are():
    x = jnp.ones((64, 64), jnp.float64)
    assert "optimization_barrier" not in str(jax.make_jaxpr(mr.accurate_sums(jnp.sum))(x))


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 24), min_size=1, max_size=4).filter(
        lambda s: math.prod(s) >= 512
    ),
    data=st.data(),
)
def test_accurate_sums_equal_float64_sums_over_any_axes(shape, data):
    axes = tuple(
        sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1), label="axes"))
    )
    x = np.random.default_rng(len(shape)).uniform(0.5, 1.5, shape).astype(np.float32)
    got = mr.accurate_sums(lambda x: x.sum(axis=axes))(x)
    assert got.shape == np.asarray(x).sum(axis=axes).shape
    assert _relative_error(got, x, axes) <= 1e-5


def test_cpu_program_rewrites_sums_exactly_where_the_options_turn_the_reduce_fusion_off():
    def with_conv(w, x):
        h = lax.conv(x, w, window_strides=(1, 1), padding="SAME")
        return (h - h.mean(axis=(0, 2, 3), keepdims=True)).var()

    def dense(w, x):
        return (x.reshape(8, -1) @ jnp.ones((3 * 16 * 16, 4)) * w.sum()).var()

    w, x = jnp.ones((4, 3, 3, 3)), jnp.linspace(0.0, 1.0, 8 * 3 * 16 * 16).reshape(8, 3, 16, 16)
    for fn, rewritten in ((with_conv, True), (dense, False)):
        program = mr.cpu_program(jax.value_and_grad(fn))
        text = str(jax.make_jaxpr(program)(w, x))
        assert ("optimization_barrier" in text) == rewritten, fn.__name__
        options = mr.cpu_compiler_options(jax.make_jaxpr(program)(w, x))
        got = jax.jit(program, compiler_options=options)(w, x)
        np.testing.assert_allclose(got[0], jax.value_and_grad(fn)(w, x)[0], rtol=1e-5)
