"""Rewriting a traced program equation by equation, in every sub-jaxpr, and running it.

The one walk behind bridge_mr's CPU program rewrites (`canonical_layouts`, `accurate_sums`): a
rule maps an equation to the equations that replace it (or None to keep it), and `rewrite`
applies it to a closed jaxpr and to every jaxpr in its equations' params (scan and while bodies,
conditionals' branches, nested jits, checkpoints), returning the same object where nothing
changed. `rewritten` traces a function, rewrites its jaxpr and evaluates that, so the result
composes with JAX's transformations like the function itself. `rebind` binds one equation's
primitive again, to other operands or with some params changed (how the packed strategy
evaluates a program equation by equation).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jax.extend import core

F = TypeVar("F", bound=Callable[..., Any])

#: An equation -> its replacement equations, or None to keep it.
Rule = Callable[[core.JaxprEqn], "list[core.JaxprEqn] | None"]


def rewritten(fn: F, rules: Callable[[core.ClosedJaxpr], Sequence[Rule]]) -> F:
    """`fn`, traced on each call, its jaxpr rewritten by `rules(jaxpr)` (in order), evaluated.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).
      rules: given the traced program, the rules to apply to it (none: it runs as traced).

    Returns:
      A function with `fn`'s signature and results.
    """

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        for rule in rules(closed):
            closed = rewrite(closed, rule)
        out = core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return run  # type: ignore[return-value]


def rewrite(closed: core.ClosedJaxpr, rule: Rule) -> core.ClosedJaxpr:
    """`closed` with `rule` applied to every equation, in every sub-jaxpr."""
    jaxpr = _open(closed.jaxpr, rule)
    return closed if jaxpr is closed.jaxpr else core.ClosedJaxpr(jaxpr, closed.consts)


def equations(fn: Callable[..., jax.Array], original: core.JaxprEqn) -> list[core.JaxprEqn]:
    """The equations of `fn` traced on `original`'s operands, writing `original`'s outputs.

    `fn` takes the operands as arrays and returns the one output; it must close over no array.
    """
    avals: list[Any] = [atom.aval for atom in original.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    small = jax.make_jaxpr(fn)(*specs)
    assert not small.consts, "a replacement closed over an array"
    rename: dict[Any, Any] = dict(zip(small.jaxpr.invars, original.invars, strict=True))
    rename.update(zip(small.jaxpr.outvars, original.outvars, strict=True))
    return [
        eqn.replace(
            invars=[rename.get(v, v) if isinstance(v, core.Var) else v for v in eqn.invars],
            outvars=[rename.get(v, v) for v in eqn.outvars],
            source_info=original.source_info,
            ctx=original.ctx,
        )
        for eqn in small.jaxpr.eqns
    ]


def rebind(eqn: core.JaxprEqn, values: Sequence[Any], **changed: Any) -> list[Any]:
    """`eqn`'s primitive bound to `values`, its params updated by `changed`: its outputs."""
    params = eqn.primitive.get_bind_params({**eqn.params, **changed})
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _open(jaxpr: core.Jaxpr, rule: Rule) -> core.Jaxpr:
    """`jaxpr` rewritten, or `jaxpr` itself when nothing changed."""
    eqns: list[core.JaxprEqn] = []
    changed = False
    for eqn in jaxpr.eqns:
        replacement = rule(eqn)
        if replacement is None:
            params = {name: _param(value, rule) for name, value in eqn.params.items()}
            same = all(params[name] is value for name, value in eqn.params.items())
            replacement = [eqn] if same else [eqn.replace(params=params)]
        changed = changed or replacement != [eqn]
        eqns += replacement
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _param(value: Any, rule: Rule) -> Any:
    if isinstance(value, core.ClosedJaxpr):
        return rewrite(value, rule)
    if isinstance(value, core.Jaxpr):
        return _open(value, rule)
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, core.ClosedJaxpr | core.Jaxpr) for v in value)
    ):
        rewritten_ = tuple(_param(v, rule) for v in value)
        return value if all(a is b for a, b in zip(rewritten_, value, strict=True)) else rewritten_
    return value
