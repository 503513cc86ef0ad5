"""Client work of any kind: map_fn's per-client function runs on Beam as it is (placed_map).

Convolutions, pooling, scans of local steps, while loops with per-client trip counts and
from_torch client functions, each equal to jax.jit of the same program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

beam = pytest.importorskip("apache_beam")
from helpers.beam import (  # noqa: E402
    CLASSES,
    SIDE,
    assert_close,
    cnn_loss,
    cnn_records,
    cnn_server,
    jit_of,
    local_sgd,
)

import bridge_mr.beam as bb  # noqa: E402
from bridge_mr import jax_core as mr  # noqa: E402

F32 = np.float32
EXAMPLES = 6


def cnn_round(server, data):
    """A FedAvg round of a CNN: conv, max-pool and 3 local SGD steps per client."""
    deltas = mr.map_fn(local_sgd(cnn_loss, 0.05), (mr.broadcast(server), data))
    return jax.tree.map(jnp.add, server, mr.reduce_mean(deltas))


def test_a_cnn_round_equals_jit():
    recs = cnn_records(10, seed=0, examples=EXAMPLES, weighted=False)
    got = bb.run(cnn_round, (cnn_server(),), recs, bundle_size=4)
    assert_close(got, jit_of(cnn_round, cnn_server(), recs), tol=1e-4)


def cnn_meta_gradient(server, data):
    """The gradient of the post-round loss through the CNN round (its local steps included)."""

    def after_round(s):
        new = cnn_round(s, data)
        return mr.reduce_mean(mr.map_fn(cnn_loss, (mr.broadcast(new), data)))

    return jax.value_and_grad(after_round)(server)


@pytest.mark.slow
def test_a_gradient_through_a_cnn_round_equals_jit():
    recs = cnn_records(6, seed=1, examples=EXAMPLES, weighted=False)
    got = bb.run(cnn_meta_gradient, (cnn_server(),), recs, bundle_size=4)
    assert_close(got, jit_of(cnn_meta_gradient, cnn_server(), recs), tol=1e-4)


def halvings(server, x):
    """A while loop whose trip count differs per client (halve until below the server's bound)."""

    def client(bound, v):
        def body(carry):
            value, steps = carry
            return value / 2, steps + 1

        return jax.lax.while_loop(lambda c: c[0] > bound, body, (v, 0))[1]

    steps = mr.map_fn(client, (mr.broadcast(server), x))
    return mr.reduce_sum(steps), mr.reduce_mean(steps.astype(jnp.float32))


def test_a_while_loop_with_per_client_trip_counts_equals_jit():
    recs = [(F32(v),) for v in (1.0, 3.0, 40.0, 1000.0, 7.0)]
    got = bb.run(halvings, (F32(1.5),), recs, bundle_size=2)
    assert_close(got, jit_of(halvings, F32(1.5), recs))


@pytest.mark.slow
def test_a_from_torch_client_function_equals_jit():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchax")
    import bridge_mr

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
            self.out = torch.nn.Linear(2 * 4 * 4, CLASSES)

        def forward(self, x):
            h = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.out(h.flatten(1))

    torch.manual_seed(0)
    net = Net()
    logits = bridge_mr.from_torch(lambda params, x: torch.func.functional_call(net, params, (x,)))
    params = {k: v.detach().numpy() for k, v in net.named_parameters()}

    def loss(p, data):
        z = logits(p, data["x"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), data["y"][:, None], 1))

    def round_(server, data):
        grads = mr.map_fn(jax.grad(loss), (mr.broadcast(server), data))
        return jax.tree.map(lambda a, g: a - 0.1 * g, server, mr.reduce_mean(grads))

    rng = np.random.default_rng(2)
    recs = [
        (
            {
                "x": rng.normal(size=(EXAMPLES, 1, SIDE, SIDE)).astype(F32),
                "y": rng.integers(0, CLASSES, size=EXAMPLES).astype(np.int32),
            },
        )
        for _ in range(5)
    ]
    got = bb.run(round_, (params,), recs, bundle_size=2)
    assert_close(got, jit_of(round_, params, recs), tol=1e-4)


def maps_in_a_scan(server, x, kernels):
    """map_fn inside a scan at the program's level: its placed_map runs within the scan body.

    The convolution's kernel is each client's own plus one computed from the server value:
    vmapped over a symbolic bundle size it would be a grouped convolution XLA cannot compile.
    """
    shared = jnp.full((3, 3, 1, 1), 0.1, jnp.float32) * server

    def client(image, kernel):
        dims = ("NHWC", "HWIO", "NHWC")
        return jnp.tanh(
            jax.lax.conv_general_dilated(
                image, kernel + shared, (1, 1), "SAME", dimension_numbers=dims
            )
        )

    def step(images, _):
        return mr.map_fn(client, (images, kernels)), None

    out, _ = jax.lax.scan(step, x, None, length=2)
    return mr.reduce_sum(out)


def test_a_map_inside_a_scan_equals_jit():
    rng = np.random.default_rng(3)
    recs = [
        (rng.normal(size=(1, 4, 4, 1)).astype(F32), rng.normal(size=(3, 3, 1, 1)).astype(F32))
        for _ in range(5)
    ]
    got = bb.run(maps_in_a_scan, (F32(2.0),), recs, bundle_size=2)
    assert_close(got, jit_of(maps_in_a_scan, F32(2.0), recs), tol=1e-5)
