"""What the Beam tests share: `jax.jit` of a program over the stacked records to compare with,
local SGD, and a small CNN (its loss, initial parameters and clients' records)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bridge_mr import jax_core as mr


def jit_of(fn: Callable[..., Any], server: Any, recs: Sequence[Any], *more: Any) -> Any:
    """`fn(server, *more, *stacked records)` under jit, with one client per record."""
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *recs)
    return jax.jit(mr.program(clients=len(recs))(fn))(server, *more, *stacked)


def assert_close(got: Any, expected: Any, tol: float = 2e-5) -> None:
    """Same tree, same dtypes, values within `tol` (relative and absolute)."""
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def local_sgd(loss: Callable[[Any, Any], Any], lr: float) -> Callable[[Any, Any], Any]:
    """A client's update: the delta of 3 local SGD steps of rate `lr` on `loss(params, data)`."""

    def local(params: Any, data: Any) -> Any:
        def step(p: Any, _: Any) -> tuple[Any, None]:
            return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p, data)), None

        new, _ = jax.lax.scan(step, params, None, length=3)
        return jax.tree.map(jnp.subtract, new, params)

    return local


# The tests' CNN: 8x8 one-channel images, a 3x3 convolution with 4 channels, ReLU, 2x2 max-pool
# and a linear layer to 3 classes.
SIDE, CHANNELS, CLASSES = 8, 4, 3


def cnn_logits(params: Any, images: Any) -> Any:
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(images, params["k"], (1, 1), "SAME", dimension_numbers=dims)
    h = jax.lax.reduce_window(
        jax.nn.relu(h), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
    )
    return h.reshape(images.shape[0], -1) @ params["w"]


def cnn_loss(params: Any, data: Any) -> Any:
    """Cross-entropy of the CNN on one client's {"x": [examples, 8, 8, 1], "y": [examples]}."""
    logits = cnn_logits(params, data["x"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), data["y"][:, None], 1))


def cnn_server() -> dict[str, np.ndarray]:
    """The CNN's initial parameters (fixed seed)."""
    rng = np.random.default_rng(0)
    return {
        "k": (rng.normal(size=(3, 3, 1, CHANNELS)) / 3).astype(np.float32),
        "w": (rng.normal(size=((SIDE // 2) ** 2 * CHANNELS, CLASSES)) / 8).astype(np.float32),
    }


def cnn_records(count: int, seed: int, examples: int, *, weighted: bool) -> list[tuple[Any, ...]]:
    """`count` clients' records: ({"x", "y"},), or with `weighted` ({"x", "y"}, weight)."""
    rng = np.random.default_rng(seed)
    records: list[tuple[Any, ...]] = []
    for _ in range(count):
        data = {
            "x": rng.normal(size=(examples, SIDE, SIDE, 1)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size=examples).astype(np.int32),
        }
        records.append((data, np.float32(rng.uniform(0.5, 2.0))) if weighted else (data,))
    return records


# The Dask workers unpickle a pipeline's functions by module and name: these live here, in a
# module the workers import (pytest adds tests/ to sys.path, which their processes inherit), not
# in a test module (importlib mode names it `tests.beam.test_x`, which no worker can import).
def write_client_files(directory: Path, recs: Sequence[tuple[Any, ...]]) -> None:
    """One `client-NNN.npz` per ({"x", "y"}, weight) record."""
    for i, (data, weight) in enumerate(recs):
        np.savez(directory / f"client-{i:03d}.npz", x=data["x"], y=data["y"], weight=weight)


def parse_client_file(readable: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A record from a `fileio.ReadableFile` that `write_client_files` wrote."""
    with readable.open() as f:
        arrays = np.load(f)
        return {"x": arrays["x"], "y": arrays["y"]}, arrays["weight"][()]
