"""Per-primitive client rules: which equations keep clients apart.

A value is *placed* when its type has the client-count dimension `n` (`placement_axis`). A
client rule (`client_rule`), registered right after it is defined as JAX registers its rules
after each primitive, refuses an equation with placed operands unless each client's slice of
an output depends only on that client's slices of the inputs and on server values; a primitive
without a rule is refused. `Checker` classifies an equation (server, client, mixing) and
applies the rules, recursively through loop and call bodies. The sums over clients are
`_reductions`' rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import jax
import numpy as np
from jax.extend import core as jex_core

from ._jaxpr import CALLS, callee, describe


class UnsupportedProgramError(ValueError):
    """A program that `bridge_mr.beam` cannot run as a MapReduce pipeline.

    Raised when the program is split (before any pipeline runs), naming the offending
    equation: an operation that mixes clients outside a reduction (selecting one client, a
    cumulative sum or a sort over the placement axis, ...), client work that reads the client
    index, a reduction inside a loop, or a placed value among the results. It is a `ValueError`.

    Example:
      >>> def first_client(x):  # x[0] selects one client outside a reduction
      ...     return bridge_mr.jax_core.reduce_sum(x * x[0])
      >>> try:
      ...     bridge_mr.beam.split(first_client, (), (np.float32(0),))
      ... except bridge_mr.beam.UnsupportedProgramError as error:
      ...     print(error)
      bridge_mr.beam cannot run this program on Beam: `...dynamic_slice...` ... selects or
      mixes clients outside a reduction. ...
    """


_MIX_FIX = (
    "Per-client work must treat every client alike; combine clients only with reduce_sum / "
    "reduce_mean / reduce_weighted_mean (or run the program with jit)."
)
_LOOP_FIX = (
    "Reductions and broadcasts must be at the program's top level (a Python loop over rounds "
    "is fine; lax.scan / fori_loop over rounds is not): call bridge_mr.beam.run once per round."
)


def placement_axis(aval: Any, n: Any, *, what: Callable[[], str]) -> int | None:
    """The position of the dimension `n` in `aval`'s shape.

    Args:
        aval: An abstract value (anything without a shape has no client axis).
        n: The symbolic client count.
        what: Names the value, for the error.

    Returns:
        The client axis, or None for a server value.

    Raises:
        UnsupportedProgramError: A dimension is another expression of `n` (`2*n`, `n - 1`:
            clients merged with another axis or split), or `n` appears twice (clients paired
            with clients).
    """
    shape = getattr(aval, "shape", ())
    symbolic = [i for i, d in enumerate(shape) if jax.export.is_symbolic_dim(d)]
    if not symbolic:
        return None
    if len(symbolic) > 1 or not _is_n(shape[symbolic[0]], n):
        raise UnsupportedProgramError(
            f"{what()} has type {aval.str_short()}: a value may carry the client axis ({n}) "
            "once, as a dimension of its own; this one merges clients with another axis, "
            "splits them, or pairs every client with every other, which mixes clients outside "
            "a reduction. Reduce first (reduce_sum / reduce_mean), or keep the per-client work "
            "inside map_fn."
        )
    return symbolic[0]


def _is_n(d: Any, n: Any) -> bool:
    try:
        return bool(d == n)
    except jax.errors.InconclusiveDimensionOperation:
        return False


# --- the checker ------------------------------------------------------------------------------


class Checker:
    """Checks client equations (recursively through loop and call bodies) for mixing.

    Args:
        n: The symbolic client count.
        placement: The placement name, for errors.
    """

    def __init__(self, n: Any, placement: str) -> None:
        self.n = n
        self.placement = placement

    def axis(self, atom: Any, eqn: Any) -> int | None:
        """The client axis of `atom`, an operand or result of `eqn` (see `placement_axis`)."""
        return placement_axis(atom.aval, self.n, what=lambda: f"In {describe(eqn)}, a value")

    def check(self, eqn: Any, nested: str | None = None) -> None:
        """Refuses `eqn` unless it keeps clients apart.

        Args:
            eqn: A client or server equation (not a reduction).
            nested: Inside which loop body `eqn` is (None: at the top level).

        Raises:
            UnsupportedProgramError: `eqn` mixes clients, reads the client index, or is a
                MapReduce primitive inside a loop.
        """
        name = eqn.primitive.name
        ins = [self.axis(a, eqn) for a in eqn.invars]
        outs = [self.axis(v, eqn) for v in eqn.outvars]
        placed_in = any(p is not None for p in ins)
        placed_out = any(p is not None for p in outs)
        if not placed_in and not placed_out:
            if name in ("placed_sum", "placed_mean", "placed_broadcast") and nested:
                self.refuse(eqn, f"is a MapReduce primitive inside {nested}", _LOOP_FIX)
            return
        if name == "iota":
            if outs[0] == eqn.params["dimension"]:
                self.refuse(eqn, "reads the client index (an iota along the client axis)", "")
            return
        if name == "placed_broadcast":
            if placed_in or nested:
                where = "of a placed value" if placed_in else f"inside {nested}"
                self.refuse(eqn, f"is a broadcast {where}", _LOOP_FIX)
            return
        site = Site(self, eqn, ins, outs)
        if placed_in and not placed_out:
            if name in ("scan", "while", "cond"):  # A round inside a loop: say so first.
                _apply_client_rule(site)
            self.refuse(
                eqn,
                "takes a placed value to a value without the client axis: it selects or mixes "
                "clients outside a reduction",
                "Reduce with reduce_sum / reduce_mean / reduce_weighted_mean instead.",
            )
        if not placed_in:
            # A server value made placed: only a broadcast repeats it for every client, and
            # a map of server values alone computes the same for every client.
            if name not in ("broadcast_in_dim", "placed_map"):
                self.refuse(
                    eqn,
                    "makes a per-client value from server values alone, which would differ "
                    "by client index",
                    "Give each client its own data (a client record) instead.",
                )
            return
        _apply_client_rule(site)

    def check_body(self, eqn: Any, body: Any, where: str) -> None:
        """Checks the equations of `body`, a loop or call body of `eqn`, as nested in `where`."""
        jaxpr = body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body
        for var in jaxpr.invars:
            self.axis(var, eqn)
        for inner in jaxpr.eqns:
            self.check(inner, nested=where)

    def refuse(self, eqn: Any, why: str, fix: str) -> NoReturn:
        """Raises the UnsupportedProgramError naming `eqn`, `why` it is refused and the `fix`."""
        raise UnsupportedProgramError(
            f"bridge_mr.beam cannot run this program on Beam: {describe(eqn)} {why}. "
            f"Each {self.placement!r} value must be computed from that client's own data. " + fix
        )


@dataclasses.dataclass(frozen=True)
class Site:
    """An equation with placed inputs, as a client rule sees it.

    `ins` and `outs` are the client axis of each operand and result (None: a server value).
    """

    checker: Checker
    eqn: Any
    ins: list[int | None]
    outs: list[int | None]

    @property
    def axis(self) -> int:
        """The client axis of the first placed operand."""
        return next(a for a in self.ins if a is not None)

    @property
    def params(self) -> dict[str, Any]:
        """The equation's params."""
        return self.eqn.params

    def refuse(self, why: str, fix: str = _MIX_FIX) -> NoReturn:
        """Refuses the equation (see `Checker.refuse`)."""
        self.checker.refuse(self.eqn, why, fix)

    def check_body(self, body: Any, where: str) -> None:
        """Checks a loop or call body of the equation (see `Checker.check_body`)."""
        self.checker.check_body(self.eqn, body, where)


# --- client rules -----------------------------------------------------------------------------

_Rule = TypeVar("_Rule", bound=Callable[..., Any])


def registrar(table: dict[str, _Rule], names: tuple[str, ...]) -> Callable[[_Rule], _Rule]:
    """A decorator that registers its function as the rule in `table` of the primitives `names`.

    Args:
        table: The rules by primitive name.
        names: Primitive names.

    Returns:
        A decorator that registers its function and returns it unchanged.
    """

    def register(rule: _Rule) -> _Rule:
        for name in names:
            table[name] = rule
        return rule

    return register


ClientRule = Callable[[Site], None]
_CLIENT_RULES: dict[str, ClientRule] = {}


def client_rule(*names: str) -> Callable[[ClientRule], ClientRule]:
    """Registers the decorated function as the client rule of the primitives `names`.

    Args:
        *names: Primitive names.

    Returns:
        A decorator that registers its function and returns it unchanged.
    """
    return registrar(_CLIENT_RULES, names)


def _apply_client_rule(site: Site) -> None:
    name = site.eqn.primitive.name
    rule = _CLIENT_RULES.get(name)
    if rule is None:
        site.refuse(
            f"uses {name}, which bridge_mr.beam does not know to keep clients apart",
            "Express the per-client work with other operations, or run the program with jit.",
        )
    rule(site)


# Primitives whose outputs line up with their inputs dimension by dimension (up to size-1
# broadcasting), and reductions / layout changes whose per-client effect follows from the types:
# when the placement axis is in the same position in every placed operand and output, each
# client's output slice depends only on its own input slices.
_PER_CLIENT = """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos
    cosh digamma div erf erf_inv erfc exp exp2 expm1 floor igamma igamma_grad_a igammac imag
    integer_pow is_finite lgamma log log1p logistic max min mul ne eq ge gt le lt neg nextafter
    not or polygamma population_count pow random_gamma_grad real reduce_precision
    regularized_incomplete_beta rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor zeta threefry2x32
    stop_gradient broadcast_in_dim transpose squeeze dot_general reduce_sum reduce_max
    reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin random_bits
    random_split random_fold_in random_wrap random_unwrap random_seed sharding_constraint
    reshard mesh_cast device_put optimization_barrier
"""


@client_rule(*_PER_CLIENT.split())
def _per_client(site: Site) -> None:
    del site  # Types alone show that clients stay apart.


@client_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(site: Site) -> None:
    if site.params["axis"] == site.axis:
        site.refuse(f"is a {site.eqn.primitive.name} over the client axis")


@client_rule("sort")
def _sort(site: Site) -> None:
    if site.params["dimension"] == site.axis:
        site.refuse("sorts along the client axis")


@client_rule("reshape")
def _reshape(site: Site) -> None:
    eqn, p, q = site.eqn, site.axis, site.outs[0]
    if site.params.get("dimensions") is not None or q is None:
        site.refuse("reshapes across the client axis")
    before_in = int(np.prod(eqn.invars[0].aval.shape[:p], dtype=np.int64))
    before_out = int(np.prod(eqn.outvars[0].aval.shape[:q], dtype=np.int64))
    if before_in != before_out:
        site.refuse("reshapes across the client axis")


@client_rule("concatenate", "split")
def _concatenate(site: Site) -> None:
    name = site.eqn.primitive.name
    key = "dimension" if name == "concatenate" else "axis"
    if site.params[key] == site.axis or any(a is None for a in site.ins):
        site.refuse(f"{name}s along the client axis")


@client_rule("pad")
def _pad(site: Site) -> None:
    if tuple(site.params["padding_config"][site.axis]) != (0, 0, 0):
        site.refuse("pads the client axis")


@client_rule("rev")
def _rev(site: Site) -> None:
    if site.axis in site.params["dimensions"]:
        site.refuse("reverses the client axis")


@client_rule("slice", "dynamic_slice", "dynamic_update_slice")
def _slice(site: Site) -> None:
    # The output keeps the whole client axis (else it lost `n`, refused by the checker);
    # dynamic start indices along it are clamped to 0 by the full-size slice.
    name, p, ins = site.eqn.primitive.name, site.axis, site.ins
    if name == "slice" and (site.params["strides"] or (1,) * (p + 1))[p] != 1:
        site.refuse("strides over the client axis")
    if name == "dynamic_update_slice" and ins[1] is None:
        site.refuse("writes one value into every client's slice")
    if any(a is not None for a in ins[1 if name == "dynamic_slice" else 2 :]):
        site.refuse("indexes with per-client start indices")


@client_rule("gather")
def _gather(site: Site) -> None:
    dims = site.params["dimension_numbers"]
    p, q = site.ins[0], site.ins[1]
    if p is not None and q is not None:
        batched = list(dims.operand_batching_dims)
        pairs = dict(zip(batched, dims.start_indices_batching_dims, strict=True))
        if pairs.get(p) != q:
            site.refuse("gathers across clients")
    elif p is not None and p in dims.start_index_map:
        site.refuse("indexes into the client axis")
    elif q is not None and q == site.eqn.invars[1].aval.ndim - 1:
        site.refuse("gathers with the client axis as the index vector")


@client_rule("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min")
def _scatter(site: Site) -> None:
    dims = site.params["dimension_numbers"]
    p, q, u = site.ins[0], site.ins[1], site.ins[2]
    pairs = dict(zip(dims.operand_batching_dims, dims.scatter_indices_batching_dims, strict=True))
    if p is None or q is None or u is None or pairs.get(p) != q:
        site.refuse(
            "scatters across clients (e.g. the gradient of a server table indexed by "
            "per-client indices)",
            "Broadcast the table to the clients first (broadcast), so each scatters into "
            "its own copy, and reduce the results.",
        )


@client_rule("scan")
def _scan(site: Site) -> None:
    start = site.params["num_consts"] + site.params["num_carry"]
    if any(a == 0 for a in site.ins[start:]):
        site.refuse("scans over the client axis")
    site.check_body(site.params["jaxpr"], "a scan")


@client_rule("while")
def _while(site: Site) -> None:
    site.check_body(site.params["cond_jaxpr"], "a while loop's condition")
    site.check_body(site.params["body_jaxpr"], "a while loop")


@client_rule("cond")
def _cond(site: Site) -> None:
    if site.ins[0] is not None:
        site.refuse("branches on a per-client index", "Use jnp.where.")
    for branch in site.params["branches"]:
        site.check_body(branch, "a cond branch")


@client_rule("placed_map")
def _placed_map(site: Site) -> None:
    # map_fn's per-client function (its params hold one client's jaxpr): whatever its body
    # does, each client's results come from that client's slices and the unbatched values.
    for axis, batched in zip(site.ins, site.params["batched"], strict=True):
        if axis != (0 if batched else None):
            site.refuse("reads a placed value whole inside map_fn (a closure over it)")


@client_rule(*CALLS)
def _call(site: Site) -> None:
    # Calls inside loop bodies (the top level's are inlined).
    inner = callee(site.eqn)
    assert inner is not None  # Every name in CALLS has a body.
    site.check_body(inner[0], f"a {site.eqn.primitive.name} call")
