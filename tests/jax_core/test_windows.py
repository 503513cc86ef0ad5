"""jax_core._windows: max- and min-pools whose windows tile their input, as a reshape and a
reduction (the packed strategy's lowering on a TPU), against the window primitives on CPU.

Every value is compared exactly (NaN equal to NaN): ties (the first maximum chosen), NaNs and
infinities, pools over 1 to 3 dimensions in any layout; the pool's forward derivative is the
window primitive's, not a reduction's. Where windows do not tile their input, the primitive
stays. On the chip: tests/tpu (the packed rounds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from bridge_mr.jax_core import _windows

POOLS = [  # (shape, windows)
    ((2, 3, 4, 6), (1, 1, 2, 2)),  # NCHW 2x2
    ((2, 4, 6, 3), (1, 2, 2, 1)),  # NHWC 2x2
    ((3, 2, 9), (1, 1, 3)),  # 1-D, window 3
    ((1, 2, 6, 6), (1, 1, 3, 3)),
    ((2, 4, 4, 2, 2), (1, 2, 2, 2, 1)),  # 3-D
]


def _operand(rng: np.random.Generator, shape: tuple[int, ...], special: bool) -> np.ndarray:
    """Few distinct values (ties in most windows); with `special`, NaNs and infinities too."""
    x = rng.integers(-2, 3, shape).astype(np.float32)
    if special:
        x[rng.random(shape) < 0.15] = np.nan
        x[rng.random(shape) < 0.1] = np.inf
        x[rng.random(shape) < 0.1] = -np.inf
    return x


def _eqn(fn, *args, name: str | None = None):
    """The one window equation (named `name`, if given) of `fn`'s program."""
    found = [
        e
        for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
        if ("window" in e.primitive.name or e.primitive.name.startswith("select_and"))
        and name in (None, e.primitive.name)
    ]
    assert len(found) == 1, found
    return found[0]


def _pool(x, windows, name):
    init, op = (-jnp.inf, lax.max) if name == "max" else (jnp.inf, lax.min)
    return lax.reduce_window(x, init, op, windows, windows, "VALID")


def _same(got, want) -> None:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)


def _check(x, windows, name, rng) -> None:
    """The lowerings of a pool's three window equations, and the lowered pool's derivatives
    (first and second order, under vmap too), equal the primitives' exactly."""
    out_shape = tuple(n // k for n, k in zip(x.shape, windows, strict=True))
    source = jnp.asarray(rng.normal(size=out_shape), x.dtype)
    tangent = jnp.asarray(rng.normal(size=x.shape), x.dtype)

    def pool(x):
        return _pool(x, windows, name)

    def backward(source, x):  # the gradient's select_and_scatter_add
        return jax.vjp(pool, x)[1](source)[0]

    def derivative(tangent, x):  # the forward derivative's select_and_gather_add
        return jax.jvp(pool, (x,), (tangent,))[1]

    tiled = _windows.lowering(_eqn(pool, x))
    scatter = _windows.lowering(_eqn(backward, source, x, name="select_and_scatter_add"))
    gather = _windows.lowering(_eqn(derivative, tangent, x, name="select_and_gather_add"))
    _same(tiled(x), pool(x))
    _same(scatter(source, x), backward(source, x))
    _same(gather(tangent, x), derivative(tangent, x))
    _same(jax.vmap(scatter)(source[None], x[None]), backward(source, x)[None])
    # Differentiating the lowered pool gives what differentiating the primitive gives.
    _same(jax.jvp(tiled, (x,), (tangent,))[1], derivative(tangent, x))
    _same(jax.vjp(tiled, x)[1](source)[0], backward(source, x))

    def second(f):  # a second-order derivative through the pool (finite inputs only)
        return jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))), (x,), (tangent,))[1]

    if bool(jnp.all(jnp.isfinite(x))):
        _same(second(tiled), second(pool))


@pytest.mark.parametrize("special", [False, True], ids=["ties", "nan_inf"])
@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize(("shape", "windows"), POOLS)
def test_a_tiled_pool_and_its_gradients_equal_the_window_primitives(shape, windows, name, special):
    rng = np.random.default_rng(len(shape) + sum(windows))
    _check(jnp.asarray(_operand(rng, shape, special)), windows, name, rng)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["max", "min"])
def test_windows_of_only_infinities_or_signed_zeros_choose_as_xlas(name, dtype):
    """A window of only the pool's start value (-inf for a max, inf for a min) chooses nothing
    in the forward derivative and its first element in the gradient; -0 and 0 tie."""
    far = -np.inf if name == "max" else np.inf
    rows = [[far, far], [-0.0, 0.0], [0.0, -0.0], [far, np.nan], [np.nan, far], [1.0, far]]
    x = jnp.asarray(np.array(rows, np.float32).reshape(1, 1, -1), dtype)  # windows of 2
    _check(x, (1, 1, 2), name, np.random.default_rng(0))


def test_the_lowerings_run_no_window_primitive():
    x, source = jnp.ones((2, 3, 4, 4)), jnp.ones((2, 3, 2, 2))
    windows = (1, 1, 2, 2)

    def pool(x):
        return _pool(x, windows, "max")

    backward = jax.vjp(pool, x)[1]
    found = [
        _windows.lowering(_eqn(pool, x)),
        _windows.lowering(
            _eqn(lambda s, x: backward(s)[0], source, x, name="select_and_scatter_add")
        ),
        _windows.lowering(
            _eqn(lambda t, x: jax.jvp(pool, (x,), (t,))[1], x, x, name="select_and_gather_add")
        ),
    ]
    programs = [
        jax.make_jaxpr(found[0])(x),
        jax.make_jaxpr(found[1])(source, x),
        jax.make_jaxpr(found[2])(x, x),
    ]
    for program in programs:
        names = {e.primitive.name for e in program.eqns}
        assert not {n for n in names if "window" in n or n.startswith("select_and")}, names


@pytest.mark.parametrize(
    "pool",
    [
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 1, 1), "VALID"),
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "SAME"),
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 3, 3), "VALID"),
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"),
        lambda x: lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID", window_dilation=(1, 1, 2, 1)
        ),
    ],
    ids=["overlapping", "padded", "partial_last_window", "sum", "dilated"],
)
def test_windows_that_do_not_tile_keep_the_primitive(pool):
    x = jnp.ones((1, 2, 5, 8))  # 5 rows: "SAME" pads them, 2x2 and 3x3 windows leave one
    assert _windows.lowering(_eqn(pool, x)) is None


def test_an_integer_pool_keeps_the_primitive():
    x = jnp.ones((1, 2, 4, 4), jnp.int32)
    windows = (1, 1, 2, 2)
    pool = _eqn(lambda x: lax.reduce_window(x, -(2**31), lax.max, windows, windows, "VALID"), x)
    assert _windows.lowering(pool) is None


def test_a_window_primitive_with_another_selection_keeps_the_primitive():
    """JAX's window functions select with `ge` or `le` only; another selection (bound through
    JAX's private function) is not lowered."""
    from jax._src.lax import windowed_reductions as wr  # private: the only way to bind one

    windows, padding = (1, 1, 2, 2), ((0, 0),) * 4
    x, source = jnp.ones((2, 3, 4, 6)), jnp.ones((2, 3, 2, 3))

    def scatter(source, x):
        return wr._select_and_scatter_add(source, x, lax.gt_p, windows, windows, padding)

    assert _windows.lowering(_eqn(scatter, source, x)) is None
