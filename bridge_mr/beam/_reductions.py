"""Per-primitive reduction rules: which equations are sums over clients, and their contributions.

An equation with placed operands and a server result is a reduction when its rule
(`reduction_rule`, registered right after it is defined) returns the `Contribution` it is:
`placed_sum`, `placed_mean`, and the `reduce_sum` / `dot_general` contractions over the client
axis that JAX's gradients of `vmap` produce. A contribution is each client's own value (the
bundle's clients first), which the aggregation sums; any other reduction is refused by the
client rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ._jaxpr import read
from ._rules import Checker, registrar


@dataclasses.dataclass
class Contribution:
    """A reduction: the per-client step computing its contribution, and how it is combined."""

    eqn: Any
    source: Any  # The placed value that the contribution step computes from.
    kind: Literal["sum", "mean"]
    step: Callable[[dict[Any, Any]], Any] | None  # None: the contribution is `source` itself.
    result: Any  # The server variable it defines.


ReductionRule = Callable[[Any, list[int | None]], Contribution | None]
_REDUCTION_RULES: dict[str, ReductionRule] = {}


def reduction_rule(*names: str) -> Callable[[ReductionRule], ReductionRule]:
    """Registers the decorated function as the reduction rule of the primitives `names`.

    A rule takes the equation and its operands' client axes (a placed input, a server output)
    and returns the `Contribution` the equation is, or None when it is no sum over clients.

    Args:
        *names: Primitive names.

    Returns:
        A decorator that registers its function and returns it unchanged.
    """
    return registrar(_REDUCTION_RULES, names)


def contribution(eqn: Any, checker: Checker) -> Contribution | None:
    """The reduction `eqn` is.

    Args:
        eqn: An equation of the flat program.
        checker: Gives the client axes of its operands and results.

    Returns:
        The contribution, or None when `eqn` is not a reduction (placed in, server out, a sum).

    Raises:
        UnsupportedProgramError: An operand or result carries the client axis wrongly.
    """
    ins = [checker.axis(a, eqn) for a in eqn.invars]
    outs = [checker.axis(v, eqn) for v in eqn.outvars]
    if any(p is not None for p in outs) or all(p is None for p in ins):
        return None
    rule = _REDUCTION_RULES.get(eqn.primitive.name)
    return None if rule is None else rule(eqn, ins)


@reduction_rule("placed_sum", "placed_mean")
def _placed_reduction(eqn: Any, ins: list[int | None]) -> Contribution:
    del ins  # Unused: a placed reduction sums over its operand's placement axis.
    kind = "sum" if eqn.primitive.name == "placed_sum" else "mean"
    return Contribution(eqn, eqn.invars[0], kind, None, eqn.outvars[0])


@reduction_rule("reduce_sum")
def _reduce_sum(eqn: Any, ins: list[int | None]) -> Contribution | None:
    if len(eqn.invars) != 1:
        return None
    axes = tuple(int(a) for a in eqn.params["axes"])
    p = ins[0]
    if p is None or p not in axes:
        return None
    (x,) = eqn.invars
    rest = tuple(a for a in axes if a != p)

    def step(env: dict[Any, Any]) -> Any:
        value = read(env, x)
        value = jax.lax.reduce_sum_p.bind(value, axes=rest, out_sharding=None) if rest else value
        return jnp.moveaxis(value, p - sum(a < p for a in rest), 0)

    return Contribution(eqn, x, "sum", step, eqn.outvars[0])


@reduction_rule("dot_general")
def _dot_general(eqn: Any, ins: list[int | None]) -> Contribution | None:
    p, q = ins[0], ins[1]
    if p is None or q is None:
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pairs = dict(zip((int(a) for a in lc), (int(b) for b in rc), strict=True))
    if pairs.get(p) != q:
        return None
    lhs, rhs = eqn.invars
    contracting = (
        tuple(int(a) for a in lc if a != p),
        tuple(int(b) for b in rc if b != q),
    )
    batch = ((p, *(int(a) for a in lb)), (q, *(int(b) for b in rb)))
    params = {**eqn.params, "dimension_numbers": (contracting, batch)}

    def step(env: dict[Any, Any]) -> Any:
        # The client axis becomes the leading batch axis: each client's own product.
        return eqn.primitive.bind(read(env, lhs), read(env, rhs), **params)

    return Contribution(eqn, lhs, "sum", step, eqn.outvars[0])
