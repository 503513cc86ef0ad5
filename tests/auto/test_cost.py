"""The cost model itself: FLOPs, peak bytes and convolution groups read from a jaxpr, by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from bridge_mr.auto import cost

F32 = 4  # bytes


def test_a_matrix_product_counts_two_flops_per_multiply_add_and_its_live_bytes():
    found = cost(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((8, 4)), jnp.ones((4, 2))))
    assert found.flops == 2 * 8 * 4 * 2
    assert found.peak_bytes == (8 * 4 + 4 * 2 + 8 * 2) * F32  # both arguments and the result
    assert (found.conv_groups, found.while_loops) == (1, 0)


def test_a_value_is_freed_after_its_last_use():
    x = jnp.ones(1000)
    found = cost(jax.make_jaxpr(lambda a: jnp.sin(jnp.cos(a)))(x))
    # The argument, cos(a) while sin is computed from it, and sin's result.
    assert found.peak_bytes == 3 * 1000 * F32
    assert found.computed_bytes == 2 * 1000 * F32
    assert found.flops == 0  # only matrix products and convolutions count


def test_a_scan_counts_its_body_once_per_iteration():
    w = jnp.ones((8, 8))

    def loop(c0):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), c0, None, length=5)[0]

    found = cost(jax.make_jaxpr(loop)(jnp.ones((4, 8))))
    assert found.flops == 5 * 2 * 4 * 8 * 8
    assert found.computed_bytes >= 5 * 2 * 4 * 8 * F32  # the product and tanh, per iteration
    assert found.while_loops == 0


def test_a_while_loop_is_counted_once_and_reported():
    w = jnp.ones((8, 8))

    def loop(c0):
        return lax.while_loop(lambda c: c.sum() < 10.0, lambda c: c @ w, c0)

    found = cost(jax.make_jaxpr(loop)(jnp.ones((4, 8))))
    assert found.flops == 2 * 4 * 8 * 8
    assert found.while_loops == 1


def test_a_cond_counts_its_costliest_branch():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 32))

    def branchy(p, a, b):
        return lax.cond(p, lambda a, b: a @ b, lambda a, b: jnp.zeros((8, 32)), a, b)

    found = cost(jax.make_jaxpr(branchy)(True, a, b))
    assert found.flops == 2 * 8 * 16 * 32  # not the sum of both branches
    heavy = cost(jax.make_jaxpr(lambda a, b: a @ b)(a, b))
    assert found.peak_bytes >= heavy.peak_bytes


def test_grouped_convolutions_report_their_groups_and_per_group_work():
    groups, c_in, c_out, k = 4, 3, 5, 3  # per group
    x = jnp.ones((2, groups * c_in, 10, 10))
    w = jnp.ones((groups * c_out, c_in, k, k))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=groups)

    found = cost(jax.make_jaxpr(conv)(x, w))
    out = 2 * groups * c_out * 8 * 8  # [2, 20, 8, 8]
    assert found.conv_groups == groups
    assert found.flops == 2 * out * c_in * k * k  # each output reads its group's inputs only
    plain = cost(
        jax.make_jaxpr(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID"))(
            jnp.ones((2, c_in, 10, 10)), jnp.ones((c_out, c_in, k, k))
        )
    )
    assert plain.conv_groups == 1
    assert plain.flops == 2 * (2 * c_out * 8 * 8) * c_in * k * k


def test_vmap_over_per_client_weights_turns_a_convolution_into_a_grouped_one():
    clients = 6
    x = jnp.ones((clients, 1, 3, 10, 10))
    w = jnp.ones((clients, 5, 3, 3, 3))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID")

    found = cost(jax.make_jaxpr(jax.vmap(conv))(x, w))
    assert found.conv_groups == clients
    one = cost(jax.make_jaxpr(conv)(x[0], w[0]))
    assert found.flops == clients * one.flops  # the same work, grouped
