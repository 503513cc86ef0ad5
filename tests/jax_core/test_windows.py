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


@pytest.mark.parametrize("special", [False, True], ids=["ties", "nan_inf"])
@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize(("shape", "windows"), POOLS)
def test_a_tiled_pool_and_its_gradients_equal_the_window_primitives(shape, windows, name, special):
    rng = np.random.default_rng(len(shape) + sum(windows))
    x = jnp.asarray(_operand(rng, shape, special))
    out_shape = tuple(n // k for n, k in zip(shape, windows, strict=True))
    source = jnp.asarray(rng.normal(size=out_shape).astype(np.float32))
    tangent = jnp.asarray(rng.normal(size=shape).astype(np.float32))

    def pool(x):
        return _pool(x, windows, name)

    forward = _eqn(pool, x)
    _same(_windows.lowering(forward)(x), pool(x))

    def backward(source, x):  # the gradient's select_and_scatter_add
        return jax.vjp(pool, x)[1](source)[0]

    scatter = _eqn(backward, source, x, name="select_and_scatter_add")
    _same(_windows.lowering(scatter)(source, x), backward(source, x))

    def derivative(tangent, x):  # the forward derivative's select_and_gather_add
        return jax.jvp(pool, (x,), (tangent,))[1]

    gather = _eqn(derivative, tangent, x, name="select_and_gather_add")
    _same(_windows.lowering(gather)(tangent, x), derivative(tangent, x))
    # The lowering's own derivatives are the primitive's (the chosen element, not a tie's share).
    tiled = _windows.lowering(forward)
    _same(jax.jvp(tiled, (x,), (tangent,))[1], derivative(tangent, x))
    _same(jax.vjp(tiled, x)[1](source)[0], backward(source, x))


def test_the_lowering_runs_no_window_primitive():
    x = jnp.ones((2, 3, 4, 4))
    tiled = _windows.lowering(_eqn(lambda x: _pool(x, (1, 1, 2, 2), "max"), x))
    names = {e.primitive.name for e in jax.make_jaxpr(jax.grad(lambda x: tiled(x).sum()))(x).eqns}
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
