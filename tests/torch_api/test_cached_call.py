"""`map_reduce`'s cached call: a repeated signature runs its entry without rebuilding the rest.

Structural checks only (no timing): which bridge_mr functions a cached call runs, that it does
not trace, measure or key twice, and that what a hit skips cannot make it stale or unchecked.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

import bridge_mr

#: The most bridge_mr Python functions a cached forward call of a tiny round may run, with or
#: without parameters that require grad (issue 31: 35 with grad at 720a87d; 23 now).
CACHED_FORWARD_CALLS = 25


def _loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _data() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(8, 8, generator=generator),
        "b1": torch.zeros(8),
        "w2": torch.randn(8, 1, generator=generator),
    }
    batch = {"x": torch.randn(4, 16, 8, generator=generator), "y": torch.randn(4, 16, 1)}
    return params, batch


def _bridge_calls(call: Callable[[], Any]) -> collections.Counter[str]:
    """The bridge_mr functions `call` runs (Python call events in bridge_mr's own files)."""
    root = bridge_mr.__file__.rsplit("/", 1)[0]
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_a_cached_forward_runs_few_bridge_functions_and_keys_once(strategy: str) -> None:
    params, batch = _data()

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return bridge_mr.map_reduce(_loss, params, batch, strategy=strategy)

    first = forward()
    calls = _bridge_calls(forward)
    assert sum(calls.values()) <= CACHED_FORWARD_CALLS, calls
    # No full key (`call_key`), no argument checks, no strategy choice, no function walk.
    for skipped in ("call_key", "choose", "check_strategy", "check_mesh", "_function_parts"):
        assert skipped not in calls, calls
    torch.testing.assert_close(forward(), first)


@pytest.mark.parametrize("data", ["tensors", "jax_arrays"])
@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_a_cached_forward_with_parameters_that_require_grad_runs_few_bridge_functions(
    strategy: str, data: str
) -> None:
    params, batch = _data()
    params = {name: value.requires_grad_() for name, value in params.items()}
    if data == "jax_arrays":  # Client data already where the program runs (on the chip).
        batch = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}

    def forward() -> torch.Tensor:
        return bridge_mr.map_reduce(_loss, params, batch, strategy=strategy)

    first = forward()
    first.backward()
    calls = _bridge_calls(forward)
    # A JAX array's key is one function (`array_key`) more per array.
    arrays = len(batch) if data == "jax_arrays" else 0
    assert sum(calls.values()) <= CACHED_FORWARD_CALLS + arrays, calls
    for skipped in ("call_key", "choose", "check_strategy", "check_mesh", "_function_parts"):
        assert skipped not in calls, calls
    torch.testing.assert_close(forward(), first)


def test_a_cached_call_with_gradients_traces_nothing_new() -> None:
    params, batch = _data()
    params = {k: v.requires_grad_() for k, v in params.items()}
    bridge_mr.map_reduce(_loss, params, batch).backward()
    before = bridge_mr.trace_counts()["map_reduce"]
    grads = []
    for _ in range(3):
        for p in params.values():
            p.grad = None
        bridge_mr.map_reduce(_loss, params, batch).backward()
        grads.append(params["w1"].grad.clone())
    assert bridge_mr.trace_counts()["map_reduce"] == before
    torch.testing.assert_close(grads[0], grads[2])


def test_what_a_cached_key_holds_tells_calls_apart() -> None:
    params, batch = _data()
    with torch.no_grad():
        base = bridge_mr.map_reduce(_loss, params, batch, strategy="vmap")
        before = bridge_mr.trace_counts()["map_reduce"]
        # Each differs from the cached call in one thing the program depends on.
        summed = bridge_mr.map_reduce(_loss, params, batch, strategy="vmap", reduce="sum")
        fewer = bridge_mr.map_reduce(
            _loss, params, {k: v[:2] for k, v in batch.items()}, strategy="vmap"
        )
        with bridge_mr.program(placements={"clients": 4}):
            placed = bridge_mr.map_reduce(_loss, params, batch, strategy="vmap")
    torch.testing.assert_close(summed, 4 * base)
    torch.testing.assert_close(placed, base)
    assert fewer.shape == base.shape
    assert bridge_mr.trace_counts()["map_reduce"] == before + 3


def test_a_cached_call_still_checks_its_weights() -> None:
    params, batch = _data()
    weighted = lambda w: bridge_mr.map_reduce(
        _loss, params, batch, reduce="weighted_mean", weights=w, strategy="vmap"
    )
    with torch.no_grad():
        weighted(torch.ones(4))
        weighted(torch.ones(4))  # Cached now.
        with pytest.raises(ValueError, match="sum to zero"):
            weighted(torch.zeros(4))
        with pytest.raises(ValueError, match="finite"):
            weighted(torch.tensor([1.0, float("nan"), 1.0, 1.0]))


def test_clearing_caches_drops_cached_calls() -> None:
    params, batch = _data()
    with torch.no_grad():
        bridge_mr.map_reduce(_loss, params, batch, strategy="vmap")
        before = bridge_mr.trace_counts()["map_reduce"]
        bridge_mr.clear_caches()
        bridge_mr.map_reduce(_loss, params, batch, strategy="vmap")
    assert bridge_mr.trace_counts()["map_reduce"] == before + 1


def test_an_auto_choice_made_once_is_not_measured_again() -> None:
    params, batch = _data()
    with torch.no_grad():
        bridge_mr.map_reduce(_loss, params, batch)
        choices = len(bridge_mr.map_reduce_choices())
        calls = _bridge_calls(lambda: bridge_mr.map_reduce(_loss, params, batch))
    assert "choose" not in calls
    assert "_decide" not in calls
    assert len(bridge_mr.map_reduce_choices()) == choices
