"""jax_core.map_reduce on CPU: convolutions, in loops too, compile to XLA:CPU's fast layout.

XLA:CPU canonicalises convolution layouts in the entry computation only; map_reduce rewrites
every convolution of the client function (and of the gradients taken inside it) so that those
in loop bodies, conditionals and nested calls get the canonical layout as well. These tests pin
the compiled layouts and that values and gradients are those of the unrewritten function.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from jax import lax

from bridge_mr import jax_core as mr

CANONICAL = "dim_labels=b01f_01io->b01f"
STRATEGIES = [("vmap", None), ("per_client", None), ("chunks", 2)]
CLOSE = {"rtol": 2e-5, "atol": 2e-5}


def _conv(x, w, b):
    """NCHW / OIHW, as PyTorch writes it (XLA:CPU's slow layout)."""
    dims = ("NCHW", "OIHW", "NCHW")
    out = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dims)
    return jax.nn.relu(out + b[:, None, None])


def _loss(params, batch):
    x, y = batch
    h = _conv(_conv(x, params["w1"], params["b1"]), params["w2"], params["b2"])
    logits = h.reshape(h.shape[0], -1) @ params["head"]
    return -(y * jax.nn.log_softmax(logits)).sum(-1).mean()


def _local_sgd(params, data, *, unroll):
    """Local SGD steps under a scan (rolled: the convolutions run in a loop body)."""

    def step(p, batch):
        g = jax.grad(_loss)(p, batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), None

    final, _ = lax.scan(step, params, data, unroll=unroll)
    return jax.tree.map(jnp.subtract, final, params)


def _cnn_case(n=3, steps=2, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(4, 3, 3, 3)) * 0.3,
        "b1": rng.normal(size=(4,)) * 0.1,
        "w2": rng.normal(size=(5, 4, 3, 3)) * 0.3,
        "b2": rng.normal(size=(5,)) * 0.1,
        "head": rng.normal(size=(5 * 6 * 6, 3)) * 0.1,
    }
    x = rng.normal(size=(n, steps, batch, 3, 10, 10))
    y = np.eye(3)[rng.integers(0, 3, size=(n, steps, batch))]
    as_f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)
    return as_f32(params), as_f32((x, y))


def _convolutions(hlo: str) -> list[str]:
    return re.findall(r"= \S+ convolution\(.*", hlo)


@pytest.mark.parametrize(("strategy", "chunk_size"), STRATEGIES)
@pytest.mark.parametrize("unroll", [False, True], ids=["rolled", "unrolled"])
def test_every_convolution_of_a_fedavg_round_compiles_to_the_canonical_layout(
    strategy, chunk_size, unroll
):
    params, data = _cnn_case()

    def round_(p, d):
        update = lambda q, c: _local_sgd(q, c, unroll=unroll)
        return mr.map_reduce(update, p, d, strategy=strategy, chunk_size=chunk_size)

    convolutions = _convolutions(jax.jit(round_).lower(params, data).compile().as_text())
    # Per local step: two forward, two kernel gradients, one input gradient (not of the data).
    assert len(convolutions) >= 5
    slow = [c for c in convolutions if CANONICAL not in c]
    assert not slow, "\n".join(slow)


def test_the_check_sees_a_slow_layout_without_map_reduce():
    # The same loop, written without map_reduce: XLA leaves its convolutions as written.
    params, data = _cnn_case()

    def loop(p, d):
        body = lambda total, c: (total + _local_sgd(p, c, unroll=True)["w1"], None)
        return lax.scan(body, jnp.zeros_like(p["w1"]), d)[0]

    convolutions = _convolutions(jax.jit(loop).lower(params, data).compile().as_text())
    assert convolutions
    assert all(CANONICAL not in c for c in convolutions)


def _reference_mean(fn, params, clients):
    return jax.tree.map(lambda a: a.mean(0), jax.vmap(fn, (None, 0))(params, clients))


@pytest.mark.parametrize(("strategy", "chunk_size"), STRATEGIES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_fedavg_round_of_a_cnn_equals_the_unrewritten_round(strategy, chunk_size, jit):
    params, data = _cnn_case()
    update = lambda q, c: _local_sgd(q, c, unroll=False)
    run = lambda p, d: mr.map_reduce(update, p, d, strategy=strategy, chunk_size=chunk_size)
    run = jax.jit(run) if jit else run
    assert_trees_all_close(run(params, data), _reference_mean(update, params, data), **CLOSE)


# Convolutions unlike the CNN's: 1-d and 3-d, channels-last, strides with SAME padding, kernel
# and input dilation (a transposed convolution), feature groups, batch groups; each in a
# conditional, a nested jit, a checkpoint and a custom_jvp function, so that every sub-jaxpr
# kind is rewritten.
def _many_convolutions(params, x):
    x1 = x[..., 0]  # [batch, 4, width]
    out = lax.conv_general_dilated(
        jnp.swapaxes(x1, 1, 2), params["k1"], (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    ).sum()
    out += jax.jit(
        lambda a, k: lax.conv_general_dilated(
            a, k, (1, 1), ((1, 1), (0, 2)), rhs_dilation=(2, 1), feature_group_count=2
        )
    )(x, params["k2"]).sum()
    out += jax.checkpoint(
        lambda a, k: lax.conv_general_dilated(a, k, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2))
    )(x, params["k3"]).sum()
    out += lax.cond(
        out > 0,
        lambda a: lax.conv_general_dilated(
            a[None], params["k4"], (1, 1, 1), "SAME", dimension_numbers=("NCDHW", "OIDHW", "NCDHW")
        ).sum(),
        lambda a: jnp.sum(a),
        x,
    )
    out += _smooth(x, params["k2"])
    # batch_group_count: how JAX writes the kernel gradient of a grouped convolution.
    grads = jax.grad(
        lambda k: lax.conv_general_dilated(x, k, (1, 1), "VALID", feature_group_count=2).sum()
    )(params["k2"])
    return out + jnp.sum(grads**2)


def _grouped_tanh(x, k):
    return jnp.tanh(lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=2)).sum()


@jax.custom_jvp
def _smooth(x, k):
    return _grouped_tanh(x, k)


@_smooth.defjvp
def _smooth_jvp(primals, tangents):
    return jax.jvp(_grouped_tanh, primals, tangents)


def _many_case(n=3, seed=1):
    rng = np.random.default_rng(seed)
    params = {
        "k1": rng.normal(size=(3, 4, 2)),
        "k2": rng.normal(size=(6, 2, 3, 2)),
        "k3": rng.normal(size=(2, 4, 2, 2)),
        "k4": rng.normal(size=(3, 2, 2, 2, 2)),
    }
    x = rng.normal(size=(n, 2, 4, 5, 6))
    as_f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)
    return as_f32(params), as_f32(x)


@pytest.mark.parametrize(("strategy", "chunk_size"), STRATEGIES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_kind_of_convolution_keeps_its_values_and_gradients(strategy, chunk_size, jit):
    params, x = _many_case()

    def round_(p, c):
        return mr.map_reduce(_many_convolutions, p, c, strategy=strategy, chunk_size=chunk_size)

    def reference(p, c):
        return _reference_mean(_many_convolutions, p, c)

    maybe_jit = jax.jit if jit else (lambda f: f)
    tangent = jax.tree.map(jnp.ones_like, params)
    for transform in (
        lambda f: f,
        lambda f: jax.grad(f),
        lambda f: lambda p, c: jax.jvp(lambda q: f(q, c), (p,), (tangent,))[1],
        lambda f: jax.grad(lambda p, c: jnp.sum(jax.grad(f)(p, c)["k2"] ** 2)),
    ):
        got = maybe_jit(transform(round_))(params, x)
        assert_trees_all_close(got, transform(reference)(params, x), rtol=1e-4, atol=1e-4)


def test_canonical_layouts_of_an_outer_gradient_canonicalises_its_convolutions_too():
    # FedSGD: the gradient of the round's mean loss. Its convolutions come from the transpose
    # rules of the rewritten forward; wrapping the gradient rewrites those as well.
    params, (x, y) = _cnn_case()
    data = (x[:, 0], y[:, 0])

    def mean_loss(p, d):
        return mr.map_reduce(_loss, p, d, strategy="per_client")

    plain = jax.jit(jax.grad(mean_loss)).lower(params, data).compile().as_text()
    wrapped = jax.jit(mr.canonical_layouts(jax.grad(mean_loss)))
    text = wrapped.lower(params, data).compile().as_text()
    assert any(CANONICAL not in c for c in _convolutions(plain))  # The gap it closes.
    convolutions = _convolutions(text)
    assert len(convolutions) >= 5
    assert all(CANONICAL in c for c in convolutions), convolutions
    want = jax.grad(lambda p, d: _reference_mean(_loss, p, d))(params, data)
    assert_trees_all_close(wrapped(params, data), want, **CLOSE)


NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
YNN_FUSION = "__ynn_fusion"


def _round(strategy="per_client"):
    def round_(p, d):
        update = lambda q, c: _local_sgd(q, c, unroll=False)
        return mr.map_reduce(update, p, d, strategy=strategy)

    return round_


def _dense(p, d):
    features = lambda x: x.reshape(x.shape[0], -1)[:, :180]
    return mr.map_reduce(lambda q, c: jnp.tanh(features(c[0]) @ q["head"]), p, d)


def _with_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (f(*primals), jax.jvp(f, primals, tangents)[1]))
    return g


@pytest.mark.parametrize(
    "where",
    [
        lambda f: f,
        lambda f: lambda p, d: lax.cond(True, f, lambda p, d: f(p, d) * 0, p, d),
        lambda f: jax.checkpoint(f),
        lambda f: _with_jvp(f),
        lambda f: jax.grad(lambda p, d: jax.tree.leaves(f(p, d))[0].sum()),
    ],
    ids=["top", "cond", "checkpoint", "custom_jvp", "grad"],
)
def test_cpu_compiler_options_turn_ynn_fusions_off_for_programs_with_convolutions(where):
    params, data = _cnn_case()
    conv = where(lambda p, d: _round()(p, d)["w1"])
    assert mr.cpu_compiler_options(jax.make_jaxpr(conv)(params, data)) == NO_YNN
    assert mr.cpu_compiler_options(jax.make_jaxpr(where(_dense))(params, data)) == {}


def test_a_cnn_round_compiled_with_the_cpu_options_has_no_ynn_fusion_and_the_same_values():
    # Pins that this jaxlib knows the option (an unknown one fails the compile) and that it
    # reaches XLA: jaxlib's default (no process flag) has YNN fusions on.
    params, data = _cnn_case()
    traced = jax.jit(_round()).trace(params, data)
    options = mr.cpu_compiler_options(traced.jaxpr)
    default = traced.lower().compile()
    without = traced.lower().compile(options)
    assert YNN_FUSION in default.as_text()
    assert YNN_FUSION not in without.as_text()
    assert_trees_all_close(without(params, data), default(params, data), **CLOSE)
    jaxpr = jax.make_jaxpr(_dense)(params, data)
    assert mr.cpu_compiler_options(jaxpr.jaxpr) == {}  # An open jaxpr too.
