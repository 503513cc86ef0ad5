"""The cost model: what a traced program would cost, read from its jaxpr without compiling it.

`cost(closed_jaxpr)` walks the program once, every sub-jaxpr included (loop bodies times their
trip count), and returns a `Cost`: the floating-point work of its matrix products and
convolutions, a peak of live bytes (each value freed after its last use, as a buffer
assignment would), the largest group count of its convolutions (vmap over per-client weights
turns a convolution into a grouped one, clients x channels), and whether it has a loop whose
trip count the jaxpr does not tell (a while loop); and the bytes of every value it computes (an
upper bound of what a backward pass of it would keep).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import core


@dataclasses.dataclass(frozen=True)
class Cost:
    """A program's cost, as its jaxpr tells it.

    Attributes:
      flops: floating-point operations of its matrix products and convolutions (2 per
        multiply-add), loop bodies counted once per iteration (a while loop's once).
      peak_bytes: the most bytes live at once: arguments, then each value from the eqn that
        makes it to its last use (a sub-jaxpr's own peak on top of what is live around it).
      conv_groups: the largest `feature_group_count * batch_group_count` of its convolutions
        (1 when it has none, or none grouped).
      while_loops: how many while loops it runs (their trip counts are not known).
      computed_bytes: the bytes of every value it computes, loop bodies once per iteration.

    Example:
      >>> from bridge_mr.auto import cost
      >>> step = lambda c, w: (jnp.tanh(c @ w), None)
      >>> loop = lambda c, w: jax.lax.scan(lambda c, _: step(c, w), c, None, length=5)[0]
      >>> found = cost(jax.make_jaxpr(loop)(jnp.ones((4, 8)), jnp.ones((8, 8))))
      >>> found.flops, found.conv_groups, found.while_loops  # 5 products of 2*4*8*8
      (2560.0, 1, 0)
    """

    flops: float
    peak_bytes: int
    conv_groups: int
    while_loops: int
    computed_bytes: int


def cost(closed: core.ClosedJaxpr) -> Cost:
    """The cost of running `closed` (see the module).

    Args:
      closed: a closed jaxpr, e.g. `jax.make_jaxpr(f)(*args)`.

    Returns:
      Its `Cost`.

    Example:
      >>> from bridge_mr.auto import cost
      >>> c = cost(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((8, 4)), jnp.ones((4, 2))))
      >>> c.flops, c.peak_bytes  # 2*8*4*2; the arguments and the [8, 2] result: (32+8+16)*4
      (128.0, 224)
    """
    walk = _CostWalk()
    args = sum(_bytes(v.aval) for v in (*closed.jaxpr.constvars, *closed.jaxpr.invars))
    extra = walk.peak(closed.jaxpr, 1.0)
    return Cost(walk.flops, args + extra, walk.groups, walk.whiles, int(walk.computed))


class _CostWalk:
    """One pass over a jaxpr: the sums `cost` returns, and each jaxpr's peak."""

    def __init__(self) -> None:
        self.flops = 0.0
        self.computed = 0.0
        self.groups = 1
        self.whiles = 0

    def peak(self, jaxpr: core.Jaxpr, times: float) -> int:
        """Bytes live at once beyond `jaxpr`'s inputs (which its caller holds); adds its flops
        (`times` runs of it) to the totals."""
        last_use: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, core.Var):
                    last_use[v] = i
        outs = {v for v in jaxpr.outvars if isinstance(v, core.Var)}
        live, top = 0, 0
        held: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            made = sum(_bytes(v.aval) for v in eqn.outvars)
            self.computed += times * made
            top = max(top, live + made + self._inner(eqn, times))
            self._count(eqn, times)
            for v in eqn.outvars:
                if v in outs or last_use.get(v, -1) > i:
                    held[v] = _bytes(v.aval)
            live += sum(held.get(v, 0) for v in eqn.outvars)
            for v in {v for v in eqn.invars if isinstance(v, core.Var)}:
                if last_use.get(v) == i and v not in outs and v in held:
                    live -= held.pop(v)
        return top

    def _inner(self, eqn: core.JaxprEqn, times: float) -> int:
        """The largest peak of `eqn`'s sub-jaxprs (each counted for its runs)."""
        name = eqn.primitive.name
        runs = times
        if name == "scan":
            runs = times * int(eqn.params["length"])
        elif name == "while":
            self.whiles += 1
        subs = list(_sub_jaxprs(eqn.params))
        if name == "cond":  # One branch runs: count the costliest.
            return self._costliest_branch(subs, runs)
        return max((self.peak(sub, runs) for sub in subs), default=0)

    def _costliest_branch(self, branches: Sequence[core.Jaxpr], runs: float) -> int:
        tops, flops = [], []
        for branch in branches:
            before = self.flops
            tops.append(self.peak(branch, runs))
            flops.append(self.flops - before)
            self.flops = before
        self.flops += max(flops, default=0.0)
        return max(tops, default=0)

    def _count(self, eqn: core.JaxprEqn, times: float) -> None:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = _shape(eqn.invars[0].aval)
            depth = math.prod(lhs[d] for d in contract)
            self.flops += times * 2.0 * _size(eqn.outvars[0].aval) * depth
        elif name == "conv_general_dilated":
            groups = int(eqn.params["feature_group_count"]) * int(eqn.params["batch_group_count"])
            self.groups = max(self.groups, groups)
            rhs = _shape(eqn.invars[1].aval)
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, spatial...)
            window = math.prod(rhs[d] for d in spec[1:])  # in-features per group x window
            self.flops += times * 2.0 * _size(eqn.outvars[0].aval) * window


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[core.Jaxpr]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(getattr(aval, "shape", ()))


def _size(aval: Any) -> int:
    return math.prod(_shape(aval))


def _bytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # float0, key types: no buffer worth counting.
        return 0
    return _size(aval) * itemsize
