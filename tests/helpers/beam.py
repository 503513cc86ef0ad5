"""What the Beam tests compare with: `jax.jit` of the same program over the stacked records."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
