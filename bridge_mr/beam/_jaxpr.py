"""Generic jaxpr tools: one flat list of equations, dead-code elimination, describing equations.

Nothing here knows about placements; `_rules` and `_split` build on it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jax.extend import core as jex_core

Var = jex_core.Var
Literal = jex_core.Literal

#: Call-like primitives whose body `flatten` inlines (only their forward computation is needed).
CALLS = frozenset(
    {"jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat2"}
)


@dataclasses.dataclass
class Flat:
    """A program as one flat list of equations (calls inlined), with its constants."""

    invars: list[Any]
    consts: dict[Any, Any]
    eqns: list[Any]
    outvars: list[Any]


def flatten(closed: Any) -> Flat:
    """Inlines every call (jit, custom_jvp/vjp, checkpoint) and renames variables apart.

    Args:
        closed: A `ClosedJaxpr`.

    Returns:
        The program as one flat list of equations, its constants keyed by fresh variables.
    """
    consts: dict[Any, Any] = {}
    eqns: list[Any] = []
    invars = [Var(v.aval) for v in closed.jaxpr.invars]
    outvars = _inline(closed.jaxpr, list(closed.consts), list(invars), eqns, consts)
    return Flat(invars, consts, eqns, outvars)


def _inline(
    jaxpr: Any, const_values: list[Any], args: list[Any], eqns: list[Any], consts: dict[Any, Any]
) -> list[Any]:
    env: dict[Any, Any] = {}
    for var, value in zip(jaxpr.constvars, const_values, strict=True):
        fresh = Var(var.aval)
        consts[fresh] = value
        env[var] = fresh
    env.update(zip(jaxpr.invars, args, strict=True))

    def sub(atom: Any) -> Any:
        return atom if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        invars = [sub(a) for a in eqn.invars]
        inner = callee(eqn)
        if inner is None:
            outvars = [Var(v.aval) for v in eqn.outvars]
            eqns.append(eqn.replace(invars=invars, outvars=outvars))
        else:
            body, body_consts = inner
            outvars = _inline(body, body_consts, invars, eqns, consts)
        env.update(zip(eqn.outvars, outvars, strict=True))
    return [sub(a) for a in jaxpr.outvars]


def callee(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The body of a call-like equation (its forward computation).

    Args:
        eqn: An equation.

    Returns:
        (the body's jaxpr, its constants) when `eqn` is a call (`CALLS`), else None.
    """
    name = eqn.primitive.name
    if name == "remat2":
        return eqn.params["jaxpr"], []
    if name not in CALLS:
        return None
    closed = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
    if isinstance(closed, jex_core.ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def dce(flat: Flat) -> None:
    """Drops equations whose outputs nothing uses (e.g. broadcasts that `map_fn` bypassed).

    Args:
        flat: The program; its `eqns` are replaced by the live ones, in order.
    """
    live = {v for v in flat.outvars if isinstance(v, Var)}
    kept = []
    for eqn in reversed(flat.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, Var))
    flat.eqns = kept[::-1]


def read(env: dict[Any, Any], atom: Any) -> Any:
    """The value of `atom` (a variable bound in `env`, or a literal)."""
    return atom.val if isinstance(atom, Literal) else env[atom]


def uses(eqns: list[Any]) -> set[Any]:
    """The variables the equations read."""
    return {v for eqn in eqns for v in eqn.invars if isinstance(v, Var)}


def defs(eqns: list[Any]) -> list[Any]:
    """The variables the equations define, in order."""
    return [v for eqn in eqns for v in eqn.outvars]


def ordered(candidates: list[Any], wanted: set[Any]) -> list[Any]:
    """The members of `wanted` in the order of `candidates`, each once."""
    seen: set[Any] = set()
    out = []
    for v in candidates:
        if v in wanted and v not in seen:
            seen.add(v)
            out.append(v)
    return out


def describe(eqn: Any) -> str:
    """An equation as JAX prints it, with the user's source line when JAX recorded one."""
    text = " ".join(str(eqn).split())
    if len(text) > 200:
        text = text[:200] + " ..."
    where = _user_frame(eqn)
    return f"`{text}`" + (f" (from {where})" if where else "")


def _user_frame(eqn: Any) -> str | None:
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return None
    skip = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, os.sep + "bridge_mr" + os.sep)
    for frame in traceback.frames:
        if not any(part in frame.file_name for part in skip):
            return f"{frame.file_name}:{frame.line_num}"
    return None
