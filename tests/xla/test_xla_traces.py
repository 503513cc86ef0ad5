"""The torch-xla runner traces a function as often as the DLPack runner does: once per signature.

It lowers the traced program in the context it was traced in (torch-xla's mesh, GSPMD), so
JAX's trace cache serves the lowering; before, it wrapped the jitted program in a second jit
under another configuration and traced the user's function again.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

import bridge_mr

pytestmark = pytest.mark.xla


def _trace_counts(device: Any) -> tuple[int, int]:
    """(traces after forward, traces after forward and backward) of a fresh function."""
    layer = bridge_mr.torch_function(lambda w, x: jnp.tanh(x @ w))
    w = torch.ones(3, 2, device=device, requires_grad=True)
    x = torch.ones(4, 3, device=device)
    out = layer(w, x)
    after_forward = layer.trace_count
    out.sum().backward()
    return after_forward, layer.trace_count


def test_xla_and_cpu_calls_trace_equally_often(xla: Any) -> None:
    # XLA first: torch's autograd engine sizes its device queues at its first backward, and
    # torch-xla reports its devices only once its runtime has started.
    on_xla = _trace_counts(xla.device())
    xla.sync()
    cpu = _trace_counts("cpu")
    assert cpu == (1, 2)
    assert on_xla == cpu


def test_lowering_leaves_the_partitioner_setting_of_other_threads_alone(xla: Any) -> None:
    """GSPMD is chosen with JAX's thread-local config context, not a process-wide flip."""
    seen: list[bool] = []
    inside: list[bool] = []
    lowering = threading.Event()
    done = threading.Event()

    def watch() -> None:
        lowering.wait(timeout=60)
        seen.append(bool(jax.config.jax_use_shardy_partitioner))
        done.set()

    before = bool(jax.config.jax_use_shardy_partitioner)
    watcher = threading.Thread(target=watch)
    watcher.start()

    def fn(x: jax.Array) -> jax.Array:
        inside.append(bool(jax.config.jax_use_shardy_partitioner))
        lowering.set()  # Runs while the runner traces, inside its context.
        done.wait(timeout=60)
        return jnp.sin(x)

    bridge_mr.torch_function(fn)(torch.ones(3, device=xla.device()))
    xla.sync()
    watcher.join(timeout=60)
    assert inside == [False]  # Traced once, with GSPMD, in this thread...
    assert seen == [before]  # ...while another thread kept its setting.
    assert bool(jax.config.jax_use_shardy_partitioner) == before
