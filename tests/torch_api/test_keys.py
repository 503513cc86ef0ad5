"""Every cache key of the torch frontend holds one context (`_keys.context`), so none can miss a
part of it; and a change of that context is a new key for each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import bridge_mr
from bridge_mr.torch_api import _keys


def _three_keys() -> list[object]:
    x = torch.ones(2, 3)
    leaves, treedef = jax.tree_util.tree_flatten(((x,), {}))
    full, _, _ = _keys.call_key(leaves, treedef, grad=True)
    cached = _keys.cached_key(jnp.sin, ({"x": x}, {"y": x}, None), ("mean",))
    assert cached is not None
    replay = _keys.trace_key(jax.tree.structure((x,)), (jax.typeof(jnp.ones(3)),))
    return [full, cached[0], replay]


def _other_promotion() -> str:
    return "standard" if jax.config.jax_numpy_dtype_promotion == "strict" else "strict"


def test_the_full_cached_and_replay_keys_hold_the_one_context(monkeypatch):
    marker = ("the", "context")
    monkeypatch.setattr(_keys, "context", lambda: marker)
    for key in _three_keys():
        assert marker in key  # type: ignore[operator]


@pytest.mark.parametrize(
    "change",
    [
        lambda: bridge_mr.program(placements={"clients": 4}),
        lambda: jax.numpy_dtype_promotion(_other_promotion()),
        lambda: jax.default_matmul_precision("highest"),
        lambda: jax.set_mesh(jax.make_mesh((1,), ("clients",))),
    ],
    ids=["placement", "promotion", "precision", "mesh"],
)
def test_each_key_changes_with_the_context(change):
    before = _three_keys()
    with change():
        during = _three_keys()
    assert all(b != d for b, d in zip(before, during, strict=True))
    assert _three_keys() == before
