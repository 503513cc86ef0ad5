"""jax_core.vmap_packed and map_reduce(strategy="packed"): clients packed into their channels
give vmap's values and gradients.

Checked on CPU against `jax.vmap`: convolutions of every layout, stride, padding, dilation and
group count with per-client or shared kernels and inputs (and their gradients, which hold the
kernel-gradient and input-gradient convolutions), in float64 to the order of the sums and in
float32; a CNN's local training in a `lax.scan` (from per-client and from shared parameters)
and map_reduce rounds of it, with the flattened activations used by torch's linear layer and
otherwise; the program's structure (dense convolutions, activations packed between them and
into the linear layer, its weights carried packed); a NaN spreading within its chunk only. On
the chip: tests/tpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from helpers.jax_precision import float32_and_float64
from jax import lax

import bridge_mr.jax_core.settings as jax_core_settings
from bridge_mr import jax_core as mr
from bridge_mr.jax_core import _patched


def _random_convolution(rng: np.random.Generator, dtype: type, clients: int):
    """A convolution of random layouts, strides, padding, dilations and groups: its function of
    (kernel, input) and stacked operands for `clients` clients."""
    nd = int(rng.integers(1, 3))
    groups = int(rng.choice([1, 1, 2]))
    per_group_in, out = int(rng.integers(1, 4)), groups * int(rng.integers(1, 4))
    spatial = [int(rng.integers(4, 8)) for _ in range(nd)]
    window = [int(rng.integers(1, 4)) for _ in range(nd)]
    lhs_spec, rhs_spec, out_spec = (tuple(int(i) for i in rng.permutation(nd + 2)) for _ in "abc")
    batch = int(rng.integers(1, 4))
    x = rng.normal(size=[clients, batch, per_group_in * groups, *spatial])
    k = rng.normal(size=[clients, out, per_group_in, *window])
    strides = tuple(int(s) for s in rng.integers(1, 3, nd))
    padding = tuple((int(lo), int(hi)) for lo, hi in rng.integers(0, 3, (nd, 2)))
    lhs_dilation = tuple(int(d) for d in rng.integers(1, 3, nd))
    rhs_dilation = tuple(int(d) for d in rng.integers(1, 3, nd))
    numbers = lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec)

    def conv(kernel, inputs):
        return lax.conv_general_dilated(
            inputs,
            kernel,
            strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            numbers,
            feature_group_count=groups,
        )

    # Each operand laid out as its spec says: dimension i of (N, C, spatial...) at spec[i].
    lhs = jnp.asarray(np.transpose(x, [0, *(1 + np.argsort(lhs_spec))]), dtype)
    rhs = jnp.asarray(np.transpose(k, [0, *(1 + np.argsort(rhs_spec))]), dtype)
    return conv, rhs, lhs


#: Random convolutions a case (each traces and compiles four programs: ~1.7 s on a 2-core CI
#: machine; 12 a case made this file the main leg's slowest).
RANDOM_CONVOLUTIONS = 6


@float32_and_float64(2e-5, 1e-12)
@pytest.mark.parametrize("batched", ["both", "kernel", "input"])
def test_a_packed_convolution_and_its_gradients_equal_vmaps(dtype, close, batched):
    """Per-client kernels on per-client inputs (the block-diagonal kernel), a shared kernel
    (the clients in the batch), shared inputs; gradients hold the transposed convolutions."""
    rng = np.random.default_rng({"both": 0, "kernel": 1, "input": 2}[batched])
    clients = 3
    for _ in range(RANDOM_CONVOLUTIONS):
        conv, kernels, inputs = _random_convolution(rng, dtype, clients)
        if batched == "kernel":
            inputs = inputs[0]
        if batched == "input":
            kernels = kernels[0]
        axes = (None if batched == "input" else 0, None if batched == "kernel" else 0)
        cotangent = jnp.asarray(
            rng.normal(size=jax.eval_shape(jax.vmap(conv, axes), kernels, inputs).shape), dtype
        )

        def loss(k, x, c=cotangent, f=conv):
            return jnp.sum(jnp.tanh(f(k, x)) * c, axis=tuple(range(1, c.ndim)))

        def packed(k, x, f=conv):
            # vmap_packed batches every argument: shared operands enter through a closure.
            if batched == "kernel":
                return mr.vmap_packed(lambda k_: f(k_, x), clients)(k)
            if batched == "input":
                return mr.vmap_packed(lambda x_: f(k, x_), clients)(x)
            return mr.vmap_packed(f, clients)(k, x)

        assert_trees_all_close(
            packed(kernels, inputs), jax.vmap(conv, axes)(kernels, inputs), **close
        )

        def packed_loss(k, x, f=conv, c=cotangent):
            return jnp.sum(jnp.tanh(packed(k, x, f)) * c)

        def vmapped_loss(k, x, a=axes, c=cotangent, f=loss):
            return jnp.sum(jax.vmap(f, (*a, 0))(k, x, c))

        want = jax.grad(vmapped_loss, (0, 1))
        assert_trees_all_close(
            jax.jit(jax.grad(packed_loss, (0, 1)))(kernels, inputs), want(kernels, inputs), **close
        )


def _features(p, x):
    """A small CNN's convolutions: conv, ReLU (a custom_jvp), max-pool, conv with bias, ReLU."""
    numbers = ("NCHW", "OIHW", "NCHW")
    h = lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=numbers)
    h = jax.nn.relu(h + p["b1"][None, :, None, None])
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    h = lax.conv_general_dilated(h, p["k2"], (1, 1), "VALID", dimension_numbers=numbers)
    return jnp.maximum(h + p["b2"].reshape(1, -1, 1, 1), 0)


def _model(p, x):
    """`_features`, flattened, then a linear layer."""
    h = _features(p, x)
    return h.reshape(h.shape[0], -1) @ p["w"]


def _local(server, batches):
    """Local SGD in a `lax.scan` from the server's parameters: the model delta and losses."""

    def step(p, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(
            lambda q: (
                -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(_model(q, x)), y[:, None], 1))
            )
        )(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    trained, losses = lax.scan(step, server, batches)
    return {"delta": jax.tree.map(jnp.subtract, trained, server), "loss": losses}


def _cnn_case(dtype, clients=5, steps=2, batch=3):
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, dtype)

    server = {
        "k1": normal(4, 3, 3, 3, scale=0.3),
        "b1": normal(4, scale=0.1),
        "k2": normal(6, 4, 3, 3, scale=0.3),
        "b2": normal(6, scale=0.1),
        "w": normal(6 * 2 * 2, 5, scale=0.2),
    }
    data = (
        normal(clients, steps, batch, 3, 8, 8),
        jnp.asarray(rng.integers(0, 5, (clients, steps, batch))),
    )
    return server, data


# float32: the dense convolutions add in another order than the grouped ones, and two SGD steps
# carry that on (max 2.7e-4 relative, 4.3e-5 absolute, seen); float64 agrees to 1e-12.
CNN_FLOAT32 = 1e-3


@float32_and_float64(CNN_FLOAT32, 1e-12)
def test_local_training_of_a_cnn_packed_equals_vmap(dtype, close):
    """From shared server parameters (the first step's kernels are every client's) and from
    per-client ones (every step's kernels are the client's own), values and gradients."""
    server, per_client, data = _per_client_case(dtype)
    shared = lambda d: _local(server, d)
    assert_trees_all_close(
        jax.jit(mr.vmap_packed(shared, 3))(data), jax.vmap(shared)(data), **close
    )
    _check_per_client(per_client, data, close)


def _per_client_case(dtype):
    """`_cnn_case` of 3 clients, each client's parameters its own multiple of the server's."""
    server, data = _cnn_case(dtype, clients=3)
    per_client = jax.tree.map(
        lambda a: a * jnp.arange(1, 4, dtype=dtype).reshape(-1, *[1] * a.ndim), server
    )
    return server, per_client, data


def _check_per_client(per_client, data, close):
    """`_local` packed against vmap from per-client parameters: values and gradients."""
    assert_trees_all_close(
        jax.jit(mr.vmap_packed(_local, 3))(per_client, data),
        jax.vmap(_local)(per_client, data),
        **close,
    )

    def total(run, p):
        out = run(p, data)
        return jnp.sum(out["loss"]) + sum(
            jnp.sum(jnp.sin(d)) for d in jax.tree.leaves(out["delta"])
        )

    got = jax.jit(jax.grad(lambda p: total(mr.vmap_packed(_local, 3), p)))(per_client)
    assert_trees_all_close(got, jax.grad(lambda p: total(jax.vmap(_local), p))(per_client), **close)


@float32_and_float64(CNN_FLOAT32, 1e-12)
@pytest.mark.parametrize("reduce", ["mean", "weighted_mean"])
def test_a_packed_fedavg_round_equals_chunks(dtype, close, reduce):
    """Five clients in packed chunks of two (the last padded), values and server gradient."""
    server, data = _cnn_case(dtype)
    weights = jnp.asarray([1.0, 2.0, 0.5, 1.5, 1.0], dtype) if reduce == "weighted_mean" else None

    def round_(strategy):
        def run(s):
            out = mr.map_reduce(
                _local, s, data, reduce=reduce, weights=weights, strategy=strategy, chunk_size=2
            )
            return sum(jnp.sum(d**2) for d in jax.tree.leaves(out)), out

        return jax.jit(jax.value_and_grad(run, has_aux=True))(server)

    assert_trees_all_close(round_("packed"), round_("chunks"), **close)


def test_the_packed_program_runs_dense_convolutions_on_packed_activations():
    """Every per-client convolution is dense (no feature or batch groups, as vmap's are), and
    the activations are not unpacked between the two convolutions."""
    server, data = _cnn_case(jnp.float32, clients=4)
    per_client = jax.tree.map(lambda a: jnp.stack([a] * 4), server)
    closed = jax.make_jaxpr(mr.vmap_packed(_local, 4))(per_client, data)
    vmapped = jax.make_jaxpr(jax.vmap(_local))(per_client, data)

    def equations(jaxpr, name):
        found = [e for e in jaxpr.eqns if e.primitive.name == name]
        for e in jaxpr.eqns:
            for value in e.params.values():
                if isinstance(value, jax.extend.core.ClosedJaxpr):
                    found += equations(value.jaxpr, name)
        return found

    def grouped(jaxpr):
        convs = equations(jaxpr, "conv_general_dilated")
        return [e.params["feature_group_count"] * e.params["batch_group_count"] for e in convs]

    assert max(grouped(vmapped.jaxpr)) == 4  # vmap's grouped convolutions, a group a client.
    assert set(grouped(closed.jaxpr)) == {1}
    # The first convolution's activations (4 clients x 3 images x 4 channels x 8 x 8) and the
    # pooled ones (x 4 x 4) are never transposed: they stay packed into the second convolution.
    between = {4 * 3 * 4 * 8 * 8, 4 * 3 * 4 * 4 * 4}
    sizes = [int(np.prod(e.invars[0].aval.shape)) for e in equations(closed.jaxpr, "transpose")]
    assert not between & set(sizes), sizes


def _scan_bodies(jaxpr):
    """Every scan equation's carried avals and body, nested ones included."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            carried = e.invars[
                e.params["num_consts"] : e.params["num_consts"] + e.params["num_carry"]
            ]
            found.append(([v.aval.shape for v in carried], e.params["jaxpr"].jaxpr))
        for value in e.params.values():
            if isinstance(value, jax.extend.core.ClosedJaxpr):
                found += _scan_bodies(value.jaxpr)
    return found


def test_the_linear_layer_after_the_flatten_runs_on_the_packed_channels():
    """From the server's parameters (as map_reduce passes them), the local steps carry the
    linear layer's weights held as the packed activations are ([G x 6, 2, 2, 5], not each
    client's [24, 5]), and none of the step's products runs per client (vmap's form: a batch
    dimension): the flatten never unpacks the channels."""
    server, data = _cnn_case(jnp.float32, clients=4)
    closed = jax.make_jaxpr(mr.vmap_packed(lambda d: _local(server, d), 4))(data)
    ((carried, body),) = _scan_bodies(closed.jaxpr)
    assert (4 * 6, 2, 2, 5) in carried, carried
    assert (4, 24, 5) not in carried
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # The layer, its input's and its weights' gradients.
    assert all(e.params["dimension_numbers"][1] == ((), ()) for e in dots)


def _other_head(p, x):
    """`_features`, then torch's linear layer ([out, in] weights) and the flattened activations
    used otherwise too: squared and summed, and unflattened again."""
    h = _features(p, x)
    flat = h.reshape(h.shape[0], -1)
    square = jnp.sum(flat**2, axis=1, keepdims=True)
    again = jnp.sum(jnp.tanh(flat.reshape(h.shape)), axis=(1, 2, 3))[:, None]
    return flat @ p["w"].T + 0.1 * square + again


# float64: the gradients of this sum of sines through two steps differ from vmap's by up to
# 1.1e-11 (leaves up to 90), and one client at a time (`lax.map`) differs from vmap as much.
@float32_and_float64(CNN_FLOAT32, 1e-10)
def test_a_flattened_activations_other_uses_and_torchs_linear_layer_equal_vmap(dtype, close):
    """From shared and per-client parameters, values and gradients."""
    server, data = _cnn_case(dtype, clients=3)
    server = {**server, "w": server["w"].T}

    def local(p, batches):
        def step(q, batch):
            x, y = batch
            loss, grads = jax.value_and_grad(
                lambda q: (
                    -jnp.mean(
                        jnp.take_along_axis(jax.nn.log_softmax(_other_head(q, x)), y[:, None], 1)
                    )
                )
            )(q)
            return jax.tree.map(lambda a, g: a - 0.1 * g, q, grads), loss

        trained, losses = lax.scan(step, p, batches)
        return {"delta": jax.tree.map(jnp.subtract, trained, p), "loss": losses}

    shared = lambda d: local(server, d)
    assert_trees_all_close(
        jax.jit(mr.vmap_packed(shared, 3))(data), jax.vmap(shared)(data), **close
    )
    per_client = jax.tree.map(
        lambda a: a * jnp.arange(1, 4, dtype=dtype).reshape(-1, *[1] * a.ndim), server
    )
    total = lambda run, p: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(run(p, data)))
    got = jax.jit(jax.grad(lambda p: total(mr.vmap_packed(local, 3), p)))(per_client)
    assert_trees_all_close(got, jax.grad(lambda p: total(jax.vmap(local), p))(per_client), **close)


def _flat_conv(x, k):
    """[N, C x H x W] of a convolution: its flatten is held packed (`_lanes`)."""
    h = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return h.reshape(h.shape[0], -1)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bool_])
def test_an_integer_or_bool_product_of_flattened_activations_keeps_its_type(dtype):
    """Products in vmap's type, int8 staying int8 and bool bool, also carried by a scan: of
    fewer rows than the activations (every client's product whole, each keeping its block) and
    of more (the activations' copies, each keeping one client's block)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 4, 3, 3, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, 2, 3, 3, 3)), jnp.float32)
    v = jnp.asarray(rng.integers(-3, 4, (3, 4, 6)), jnp.int8)

    def fn(x, k, v):
        flat = (_flat_conv(x, k) * 20).astype(dtype)
        v = v.astype(dtype)
        total = lax.scan(lambda c, _: (c + v[:, 0] @ flat, None), v[:, 0] @ flat, None, length=2)
        return total[0], v.T @ flat

    got, want = mr.vmap_packed(fn, 3)(x, k, v), jax.vmap(fn)(x, k, v)
    assert [a.dtype for a in got] == [jnp.dtype(dtype)] * 2
    assert_trees_all_close(got, want, rtol=0, atol=0)


def test_carries_that_swap_held_and_stacked_forms_equal_vmap():
    """Two carries that trade places each step, one a flattened activation (held) and one a
    client's own (stacked)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 4, 3, 3, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, 2, 3, 3, 3)), jnp.float32)
    u = jnp.asarray(rng.normal(size=(3, 4, 18)), jnp.float32)

    def fn(x, k, u):
        step = lambda c, _: ((c[1] * 1.5, c[0] + 1.0), None)
        return lax.scan(step, (_flat_conv(x, k), u), None, length=3)[0]

    got, want = mr.vmap_packed(fn, 3)(x, k, u), jax.vmap(fn)(x, k, u)
    assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_gradient_of_a_packed_function_that_calls_a_custom_jvp_equals_vmaps():
    """jax.grad of the packed function itself (its ReLU's rule traced before its body ran),
    a ReLU on packed and on flattened activations."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 4, 3, 3, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, 2, 3, 3, 3)), jnp.float32)
    fn = lambda x, k: jnp.sum(jax.nn.relu(_flat_conv(x, k)) ** 2)
    grad = lambda run: jax.grad(lambda k: run(fn)(x, k).sum())(k)
    assert_trees_all_close(grad(lambda f: mr.vmap_packed(f, 3)), grad(jax.vmap), rtol=1e-6)


def test_a_scan_whose_carry_starts_as_a_literal_equals_vmap():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 4, 3, 3, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, 2, 3, 3, 3)), jnp.float32)

    def fn(x, k):
        return lax.scan(lambda c, r: (c + r.sum(), r * 2), 0.0, _flat_conv(x, k))

    assert_trees_all_close(mr.vmap_packed(fn, 3)(x, k), jax.vmap(fn)(x, k), rtol=1e-6)


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_on_a_tpu_the_max_pool_is_a_reshape(platform):
    """The max-pool and its gradient lower for a TPU as a reshape and a max (faster there in
    the packed round, see jax_core._windows), elsewhere as XLA's window operations."""
    server, data = _cnn_case(jnp.float32, clients=4)
    per_client = jax.tree.map(lambda a: jnp.stack([a] * 4), server)
    traced = jax.jit(mr.vmap_packed(_local, 4)).trace(per_client, data)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    windows = text.count("stablehlo.reduce_window") + text.count("stablehlo.select_and_scatter")
    assert (windows == 0) == (platform == "tpu"), windows


@pytest.mark.parametrize(
    ("platform", "precision", "dtype", "features", "convolutions"),
    [
        ("tpu", "highest", jnp.float32, 4, 1),
        ("tpu", "highest", jnp.float32, 3, 3),
        ("tpu", "highest", jnp.float32, 0, 5),
        ("tpu", "highest", jnp.bfloat16, 4, 5),
        ("cpu", "highest", jnp.float32, 4, 5),
        ("tpu", None, jnp.float32, 4, 5),
        ("tpu", "bfloat16", jnp.float32, 4, 5),
    ],
)
def test_on_a_tpu_at_highest_convolutions_of_few_features_are_patch_products(
    platform, precision, dtype, features, convolutions, monkeypatch
):
    """A step has five convolutions: the first's forward and kernel gradient (3 features a
    client) and the second's (4) become products on a TPU at "highest" for float32 operands
    (jax_core._patched), where `settings.PACKED_PATCH_FEATURES` (4) allows; the second's input
    gradient (6 features a client) stays, and so does every one elsewhere."""
    monkeypatch.setattr(jax_core_settings, "PACKED_PATCH_FEATURES", features)
    server, data = _cnn_case(dtype, clients=4)
    per_client = jax.tree.map(lambda a: jnp.stack([a] * 4), server)
    with jax.default_matmul_precision(precision):
        traced = jax.jit(mr.vmap_packed(_local, 4)).trace(per_client, data)
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert text.count("stablehlo.convolution") == convolutions


@pytest.mark.parametrize(
    ("precision", "size", "window", "groups", "convolutions"),
    [
        (lax.Precision.HIGHEST, 6, 3, 1, 0),
        (lax.Precision.HIGH, 6, 3, 1, 1),
        (lax.Precision.HIGHEST, 12, 5, 1, 1),  # 25 window offsets, 64 outputs: over MAX_SLICES
        (lax.Precision.HIGHEST, 6, 3, 3, 1),  # grouped
        (lax.Precision.HIGHEST, 2, 3, 1, 1),  # no output
    ],
    ids=["highest", "high", "window_5x5", "grouped", "empty"],
)
def test_a_convolution_is_a_product_on_a_tpu_where_the_rule_holds(
    precision, size, window, groups, convolutions
):
    """By the convolution's own precision, its window, its groups and its output's size; each
    also traces, runs and equals vmap here (the patch form is traced on every platform)."""
    x = jnp.arange(2 * 3 * 3 * size * size, dtype=jnp.float32).reshape(2, 3, 3, size, size) / 50
    k = jnp.ones((2, 3, 3 // groups, window, window))

    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, (1, 1), "VALID", feature_group_count=groups, precision=precision
        )

    text = jax.jit(mr.vmap_packed(conv, 2)).trace(x, k).lower(lowering_platforms=("tpu",))
    assert text.as_text().count("stablehlo.convolution") == convolutions
    got = jax.jit(mr.vmap_packed(conv, 2))(x, k)
    assert_trees_all_close(got, jax.vmap(conv)(x, k), rtol=1e-6, atol=1e-6)


@float32_and_float64(CNN_FLOAT32, 1e-12)
def test_the_patch_products_and_their_gradients_equal_vmap(dtype, close, monkeypatch):
    """The TPU's form run here: `lax.platform_dependent` takes its `tpu` branch (the max-pool's
    reshape too, jax_core._windows) and the rule holds at any precision and type; four of the
    five convolutions a step are products."""
    monkeypatch.setattr(lax, "platform_dependent", lambda *a, tpu, default: tpu(*a))
    monkeypatch.setattr(_patched, "at_highest", lambda *_: True)
    _, per_client, data = _per_client_case(dtype)
    text = jax.jit(mr.vmap_packed(_local, 3)).lower(per_client, data).as_text()
    assert text.count("stablehlo.convolution") == 1
    _check_per_client(per_client, data, close)


def test_a_nan_spreads_within_its_chunk_only():
    """The zero blocks of a block-diagonal kernel turn one client's NaN into its chunk's."""
    server, (x, y) = _cnn_case(jnp.float32, clients=4)
    x = x.at[0, 1].set(jnp.nan)  # Client 0's second step: its kernels are its own by then.
    per_client = jax.tree.map(lambda a: jnp.stack([a] * 4), server)
    out = mr.vmap_packed(_local, 2)(*jax.tree.map(lambda a: a[:2], (per_client, (x, y))))
    rest = mr.vmap_packed(_local, 2)(*jax.tree.map(lambda a: a[2:], (per_client, (x, y))))
    assert np.isnan(out["loss"][:, 1]).all()  # Client 1 too, packed with client 0.
    assert np.isfinite(rest["loss"]).all()
    assert np.isfinite(jax.vmap(_local)(per_client, (x, y))["loss"][1:]).all()  # vmap: only 0.


def test_an_argument_without_the_client_axis_is_named():
    conv, kernels, inputs = _random_convolution(np.random.default_rng(0), jnp.float32, 3)
    with pytest.raises(ValueError, match=r"vmap_packed\(fn, 3\).*args\[1\] has shape \(2,"):
        mr.vmap_packed(conv, 3)(kernels, inputs[:2])


def test_without_convolutions_it_is_vmap():
    f = lambda w, x: jnp.tanh(x @ w).sum()
    w, x = jnp.ones((3, 4, 2)), jnp.ones((3, 5, 4))
    assert_trees_all_close(mr.vmap_packed(f, 3)(w, x), jax.vmap(f)(w, x), rtol=0, atol=0)
