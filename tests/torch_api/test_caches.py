"""`bridge_mr.clear_caches()`: afterwards bridge_mr keeps no user function or captured value."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

import bridge_mr


class _Captured:
    """A value a client function closes over: mutable, so the function is keyed by identity."""

    def __init__(self) -> None:
        self.scale = jnp.full((3,), 2.0, dtype=jnp.float32)


def _closure() -> tuple[Callable[..., Any], weakref.ref[Any]]:
    captured = _Captured()

    def client_loss(server: jax.Array, client: jax.Array) -> jax.Array:
        return jnp.sum(server * client * captured.scale)

    return client_loss, weakref.ref(captured)


def _alive(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is not None


def test_map_reduce_caches_hold_closures_until_cleared() -> None:
    fn, captured = _closure()
    server = torch.ones(3, requires_grad=True)
    bridge_mr.map_reduce(fn, server, torch.ones(4, 3)).backward()
    del fn
    assert _alive(captured)  # The trace of map_reduce holds the function it was traced with.
    bridge_mr.clear_caches()
    assert not _alive(captured)


def test_torch_functions_and_their_derived_programs_are_cleared() -> None:
    fn, captured = _closure()
    f = bridge_mr.torch_function(lambda fn, s, c: fn(s, c) * jnp.ones(2, jnp.float32))
    server = torch.ones(3, requires_grad=True)
    out = f(fn, server, torch.ones(3))
    # A create_graph backward builds the VJP's own torch function, which holds the trace too.
    (grad,) = torch.autograd.grad(out.sum(), server, create_graph=True)
    grad.sum().backward()
    del fn, out, grad
    assert _alive(captured)
    before = f.trace_count
    bridge_mr.clear_caches()
    assert not _alive(captured)
    assert f.trace_count == before  # Counts keep counting; the next call traces again.
    fn, _ = _closure()
    f(fn, server, torch.ones(3))
    assert f.trace_count == before + 1


def test_a_torch_function_can_drop_its_own_traces() -> None:
    fn, captured = _closure()
    f = bridge_mr.torch_function(lambda fn, s, c: fn(s, c))
    f(fn, torch.ones(3), torch.ones(3))
    del fn
    assert _alive(captured)
    f.clear_cache()
    assert not _alive(captured)


def test_the_torch_frontends_module_caches_are_registered_and_cleared() -> None:
    from bridge_mr import _caches
    from bridge_mr.auto import _choose
    from bridge_mr.dlpack import _import, _runtime
    from bridge_mr.runners import _xla
    from bridge_mr.torch_api import _custom_op, _static

    containers = {
        "dlpack devices": _runtime._cache,
        "dlpack permuted layouts": _import._PERMUTED_OK,
        "torch function identities": _static._RECENT,
        "torch function global names": _static._NAMES,
        "torch-xla embedded computations": _xla._EMBEDDED,
        "custom op traced calls": _custom_op._entries,
        "map_reduce auto choices": _choose._CHOICES,
    }
    registered = _caches.registered()
    for name, container in containers.items():
        assert registered[name] is container, name
    for name in (
        "torch function traces",
        "torch-xla global mesh",
    ):
        assert callable(registered[name]), name

    bridge_mr.map_reduce(lambda s, c: jnp.sum(s * c), torch.ones(3), torch.ones(16, 3))
    assert _static._RECENT
    assert _static._NAMES
    assert _runtime._cache
    assert bridge_mr.map_reduce_choices()
    bridge_mr.torch_api.clear_caches()
    for name, container in containers.items():
        assert not container, name
    assert bridge_mr.map_reduce_choices() == []
