"""jax_core.matmul_convolutions: grouped convolutions (vmap over per-client kernels) as batched
matrix products, with the values and gradients of the grouped convolutions.

Checked on CPU against XLA's own grouped convolution: every layout, stride, padding, dilation
and group kind, in float64 exactly (to the order of the sums) and in float32; a vmapped FedAvg
round of a CNN and its gradient; which convolutions stay. On the chip: tests/tpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_trees_all_close
from helpers.jax_precision import float32_and_float64
from jax import lax
from jax.extend import core as jax_core

from bridge_mr import jax_core as mr
from bridge_mr.jax_core import _grouped


def _random_convolution(rng: np.random.Generator, dtype: type) -> tuple[dict, jax.Array, jax.Array]:
    """A grouped convolution's params and operands: 1 to 3 spatial dims, any layouts, strides,
    padding (negative too), input and kernel dilation, feature or batch groups."""
    nd = int(rng.integers(1, 4))
    groups = int(rng.integers(2, 4))
    batch_groups = bool(rng.random() < 0.4)
    per_group_in, per_group_out = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    batch = int(rng.integers(1, 3)) * (groups if batch_groups else 1)
    features = per_group_in * (1 if batch_groups else groups)
    spatial = [int(rng.integers(3, 8 if nd < 3 else 5)) for _ in range(nd)]
    window = [int(rng.integers(1, 4)) for _ in range(nd)]
    lhs_spec, rhs_spec, out_spec = (tuple(int(i) for i in rng.permutation(nd + 2)) for _ in "abc")
    x = rng.normal(size=[batch, features, *spatial])
    w = rng.normal(size=[per_group_out * groups, features // (1 if batch_groups else groups)])
    w = rng.normal(size=[*w.shape, *window])
    params = {
        "window_strides": tuple(int(s) for s in rng.integers(1, 3, nd)),
        "padding": tuple((int(lo), int(hi)) for lo, hi in rng.integers(-1, 3, (nd, 2))),
        "lhs_dilation": tuple(int(d) for d in rng.integers(1, 3, nd)),
        "rhs_dilation": tuple(int(d) for d in rng.integers(1, 3, nd)),
        "dimension_numbers": lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec),
        "feature_group_count": 1 if batch_groups else groups,
        "batch_group_count": groups if batch_groups else 1,
        "precision": None,
        "preferred_element_type": None,
    }
    # Each operand laid out as its spec says: dimension i of (N, C, spatial...) at spec[i].
    lhs = jnp.asarray(np.transpose(x, np.argsort(lhs_spec)), dtype)
    rhs = jnp.asarray(np.transpose(w, np.argsort(rhs_spec)), dtype)
    return params, lhs, rhs


@float32_and_float64(1e-5, 1e-12)
def test_a_grouped_convolution_as_a_matmul_equals_xlas(dtype, close):
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 40:
        params, lhs, rhs = _random_convolution(rng, dtype)
        expected_shape = jax.eval_shape(
            lambda a, b, p=params: lax.conv_general_dilated_p.bind(a, b, **p, out_sharding=None),
            lhs,
            rhs,
        ).shape
        if 0 in expected_shape:
            continue
        expected = lax.conv_general_dilated_p.bind(lhs, rhs, **params, out_sharding=None)
        got = _grouped.grouped_convolution(lhs, rhs, **params)
        assert got.shape == expected.shape, params
        assert got.dtype == expected.dtype, params
        np.testing.assert_allclose(got, expected, **close, err_msg=str(params))
        checked += 1


def _client_loss(params, batch):
    """A two-layer CNN (NCHW / OIHW, as torch writes it), wide enough to be rewritten."""
    x, y = batch
    dims = ("NCHW", "OIHW", "NCHW")
    h = jax.nn.relu(
        lax.conv_general_dilated(x, params["w1"], (1, 1), "SAME", dimension_numbers=dims)
    )
    h = jax.nn.relu(
        lax.conv_general_dilated(h, params["w2"], (2, 2), "VALID", dimension_numbers=dims)
    )
    logits = h.reshape(h.shape[0], -1) @ params["head"]
    return -(y * jax.nn.log_softmax(logits)).sum(-1).mean()


def _local_sgd(params, data):
    def step(p, batch):
        g = jax.grad(_client_loss)(p, batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), None

    return jax.tree.map(jnp.subtract, lax.scan(step, params, data)[0], params)


def _round(params, data):
    deltas = jax.vmap(_local_sgd, (None, 0))(params, data)
    return jax.tree.map(lambda p, d: p + d.mean(0), params, deltas)


def _cnn_case(dtype=jnp.float32, clients=4, steps=2, batch=3):
    rng = np.random.default_rng(1)
    params = {
        "w1": rng.normal(size=(8, 3, 3, 3)) * 0.3,
        "w2": rng.normal(size=(16, 8, 3, 3)) * 0.2,
        "head": rng.normal(size=(16 * 3 * 3, 4)) * 0.1,
    }
    x = rng.normal(size=(clients, steps, batch, 3, 8, 8))
    y = np.eye(4)[rng.integers(0, 4, size=(clients, steps, batch))]
    as_dtype = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)
    return as_dtype(params), as_dtype((x, y))


def _grouped_convolutions(fn, *args) -> list[dict]:
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "conv_general_dilated":
                p = eqn.params
                if p["feature_group_count"] * p["batch_group_count"] > 1:
                    found.append(p)
            for sub in jax_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _final_loss(round_fn):
    """A meta-learning loss of the round's result: its gradient transposes the round."""

    def loss(params, data):
        new = round_fn(params, data)
        return _client_loss(new, jax.tree.map(lambda a: a[0, 0], data))

    return loss


@float32_and_float64(2e-5, 1e-11)
def test_a_vmapped_cnn_round_and_its_gradient_equal_the_grouped_program(dtype, close):
    params, data = _cnn_case(dtype)
    fast = mr.matmul_convolutions(_round)
    assert_trees_all_close(jax.jit(fast)(params, data), jax.jit(_round)(params, data), **close)
    meta, meta_fast = _final_loss(_round), _final_loss(fast)
    assert_trees_all_close(
        jax.jit(jax.grad(meta_fast))(params, data), jax.jit(jax.grad(meta))(params, data), **close
    )


def test_no_grouped_convolution_is_left_in_the_round_or_its_gradient():
    params, data = _cnn_case()
    # vmap groups the forward convolutions, the kernel gradients (feature groups) and, in the
    # gradient through the round, batch groups.
    meta = _final_loss(_round)
    grouped = _grouped_convolutions(jax.grad(meta), params, data)
    assert {p["batch_group_count"] > 1 for p in grouped} == {False, True}
    assert (
        _grouped_convolutions(jax.grad(_final_loss(mr.matmul_convolutions(_round))), params, data)
        == []
    )
    jaxpr = str(jax.make_jaxpr(mr.matmul_convolutions(_round))(params, data))
    assert "dot_general" in jaxpr
    assert jaxpr.count("conv_general_dilated") == 0  # patches and products: no convolution


def test_convolutions_the_rewrite_would_not_speed_up_stay_as_they_are():
    x = jnp.ones((5, 2, 8, 12, 12))
    shared = jnp.ones((16, 8, 3, 3))
    depthwise = jnp.ones((5, 8, 1, 3, 3))
    conv = lambda a, k, groups=1: lax.conv_general_dilated(
        a, k, (1, 1), "SAME", feature_group_count=groups
    )

    cases = {
        # A shared kernel: vmap folds the clients into the batch, nothing is grouped.
        "shared kernel": (jax.vmap(lambda a: conv(a, shared)), (x,), 0),
        # Depthwise, one channel in and out per group: too narrow for a matrix unit.
        "depthwise": (jax.vmap(lambda a, k: conv(a, k, 8)), (x, depthwise), 1),
        # A window and an output both of 32x32 positions: 1,024 slices either way.
        "full correlation": (
            jax.vmap(lambda a, k: lax.conv_general_dilated(a, k, (1, 1), ((31, 31), (31, 31)))),
            (jnp.ones((3, 1, 8, 32, 32)), jnp.ones((3, 8, 8, 32, 32))),
            1,
        ),
    }
    for name, (fn, args, groups) in cases.items():
        assert len(_grouped_convolutions(mr.matmul_convolutions(fn), *args)) == groups, name
        np.testing.assert_allclose(mr.matmul_convolutions(fn)(*args), fn(*args), err_msg=name)


def test_the_patches_come_from_the_fewer_of_window_offsets_and_output_positions():
    # The kernel gradient's "window" is the whole image (26x26) and its output the kernel's
    # 3x3: nine slices, not 676.
    def slices(fn, *args):
        return str(jax.make_jaxpr(mr.matmul_convolutions(fn))(*args)).count(" slice[")

    def kernel_grad(w, x):
        return jax.grad(lambda k: lax.conv(x, k, (1, 1), "VALID").sum())(w)

    ws, xs = jnp.ones((4, 8, 8, 3, 3)), jnp.ones((4, 2, 8, 28, 28))
    assert _grouped_convolutions(jax.vmap(kernel_grad), ws, xs)  # grouped, without the rewrite
    assert slices(jax.vmap(kernel_grad), ws, xs) == 9
    assert _grouped_convolutions(mr.matmul_convolutions(jax.vmap(kernel_grad)), ws, xs) == []
