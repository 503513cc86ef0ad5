"""Jaxpr inspection for tests."""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex_core


def live_shapes(jaxpr: Any) -> list[tuple[int, ...]]:
    """Shapes of the values a jaxpr computes and uses (dead equations dropped), sub-jaxprs too."""
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    shapes = []
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and not any(v in live for v in eqn.outvars):
            continue
        shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
        for sub in jex_core.jaxprs_in_params(eqn.params):
            shapes += live_shapes(sub)
    return shapes


def count_equations(jaxpr: Any) -> int:
    """Equations of a (closed) jaxpr, those of its sub-jaxprs (scan bodies, ...) included."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return len(inner.eqns) + sum(count_equations(sub) for sub in jex_core.subjaxprs(inner))
