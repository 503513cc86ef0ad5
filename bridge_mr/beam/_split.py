"""Splits a MapReduce program's jaxpr into the phases of TFF's DistributeAggregateForm.

The program is traced with a symbolic client count `n`. A value is *placed* when its type has
the dimension `n` (its placement axis, which `vmap` inside `map_fn` may have moved off the front);
every other value is a *server* value. Equations then fall into three kinds:

* server equations: no placed input or output (they run once, on one worker);
* client equations: a placed input or output, checked to keep clients apart — each client's
  slice of an output depends only on that client's slices of the inputs and on server values
  (they run per client: on any bundle of clients, since they are independent);
* reductions: a placed input and a server output that is a sum over the placement axis
  (`placed_sum`, `placed_mean`, and the `reduce_sum` / `dot_general` contractions over the
  placement axis that JAX's own gradients of `vmap` produce). Each becomes a per-client
  contribution and a sum in the CombineFn.

Anything else that takes placed values to server values, or that reads the client index, is
refused here, naming the equation. Rounds: a reduction's result is one round later than its
input; round k is server_prepare (server equations of round k), the broadcast of its values (a
side input), client_work (client equations of round k), client_to_server_aggregation (its
reductions), and the last server segment is server_result.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from bridge_mr import jax_core

from ._plan import Plan, Reduction, Segment

Var = jex_core.Var
Literal = jex_core.Literal

#: Exported segments' calling convention: argument 0 carries the client count as its leading
#: dimension (a float32[n, 0] array, empty), so every segment can solve `n` from its inputs.
CARRIER_DTYPE = np.float32


class UnsupportedProgramError(ValueError):
    """A program that `bridge_mr.beam` cannot run as a MapReduce pipeline.

    Raised when the program is split (before any pipeline runs), naming the offending
    equation: an operation that mixes clients outside a reduction (selecting one client, a
    cumulative sum or a sort over the placement axis, ...), client work that reads the client
    index, a reduction inside a loop, or a placed value among the results.
    """


_CALLS = frozenset({"jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"})
_REMAT = "remat2"

# Primitives whose outputs line up with their inputs dimension by dimension (up to size-1
# broadcasting), and reductions / layout changes whose per-client effect follows from the types:
# when the placement axis is in the same position in every placed operand and output, each
# client's output slice depends only on its own input slices.
_PER_CLIENT = frozenset(
    [
        "abs",
        "acos",
        "acosh",
        "add",
        "add_any",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "bessel_i0e",
        "bitcast_convert_type",
        "bessel_i1e",
        "cbrt",
        "ceil",
        "clamp",
        "clz",
        "complex",
        "conj",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "digamma",
        "div",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "igamma",
        "igamma_grad_a",
        "igammac",
        "imag",
        "integer_pow",
        "is_finite",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "max",
        "min",
        "mul",
        "ne",
        "eq",
        "ge",
        "gt",
        "le",
        "lt",
        "neg",
        "nextafter",
        "not",
        "or",
        "polygamma",
        "population_count",
        "pow",
        "random_gamma_grad",
        "real",
        "reduce_precision",
        "regularized_incomplete_beta",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "sub",
        "tan",
        "tanh",
        "xor",
        "zeta",
        "threefry2x32",
        "stop_gradient",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "dot_general",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
        "random_bits",
        "random_split",
        "random_fold_in",
        "random_wrap",
        "random_unwrap",
        "random_seed",
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "device_put",
        "optimization_barrier",
    ]
)
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


@dataclasses.dataclass
class _Flat:
    """The program as one flat list of equations (calls inlined), with its constants."""

    invars: list[Any]
    consts: dict[Any, Any]
    eqns: list[Any]
    outvars: list[Any]


def placement_axis(aval: Any, n: Any, *, what: Callable[[], str]) -> int | None:
    """The position of the dimension `n` in `aval`'s shape (None if absent).

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


# --- flattening -------------------------------------------------------------------------------


def _flatten(closed: Any) -> _Flat:
    """Inlines every call (jit, custom_jvp/vjp, checkpoint) and renames variables apart."""
    consts: dict[Any, Any] = {}
    eqns: list[Any] = []
    invars = [Var(v.aval) for v in closed.jaxpr.invars]
    outvars = _inline(closed.jaxpr, list(closed.consts), list(invars), eqns, consts)
    return _Flat(invars, consts, eqns, outvars)


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
        inner = _callee(eqn)
        if inner is None:
            outvars = [Var(v.aval) for v in eqn.outvars]
            eqns.append(eqn.replace(invars=invars, outvars=outvars))
        else:
            body, body_consts = inner
            outvars = _inline(body, body_consts, invars, eqns, consts)
        env.update(zip(eqn.outvars, outvars, strict=True))
    return [sub(a) for a in jaxpr.outvars]


def _callee(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The body of a call-like equation (its forward computation), or None."""
    name = eqn.primitive.name
    if name == _REMAT:
        return eqn.params["jaxpr"], []
    if name not in _CALLS:
        return None
    closed = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
    if isinstance(closed, jex_core.ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def _dce(flat: _Flat) -> None:
    """Drops equations whose outputs nothing uses (e.g. broadcasts that `map_fn` bypassed)."""
    live = {v for v in flat.outvars if isinstance(v, Var)}
    kept = []
    for eqn in reversed(flat.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, Var))
    flat.eqns = kept[::-1]


# --- classification ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Contribution:
    """A reduction: the per-client step computing its contribution, and how it is combined."""

    eqn: Any
    source: Any  # The placed value that the contribution step computes from.
    kind: str  # "sum" or "mean"
    step: Callable[[dict[Any, Any]], Any] | None  # None: the contribution is `source` itself.
    result: Any  # The server variable it defines.


class _Checker:
    """Checks client equations (recursively through loop and call bodies) for mixing."""

    def __init__(self, n: Any, placement: str) -> None:
        self.n = n
        self.placement = placement

    def axis(self, atom: Any, eqn: Any) -> int | None:
        return placement_axis(atom.aval, self.n, what=lambda: f"In {describe(eqn)}, a value")

    def check(self, eqn: Any, nested: str | None = None) -> None:
        """Refuses `eqn` unless it keeps clients apart (`nested`: inside which loop body)."""
        name = eqn.primitive.name
        ins = [self.axis(a, eqn) for a in eqn.invars]
        outs = [self.axis(v, eqn) for v in eqn.outvars]
        placed_in = any(p is not None for p in ins)
        placed_out = any(p is not None for p in outs)
        if not placed_in and not placed_out:
            if name in ("placed_sum", "placed_mean", "placed_broadcast") and nested:
                self._refuse(eqn, f"is a MapReduce primitive inside {nested}", _LOOP_FIX)
            return
        if name == "iota":
            if outs[0] == eqn.params["dimension"]:
                self._refuse(eqn, "reads the client index (an iota along the client axis)", "")
            return
        if name == "placed_broadcast":
            if placed_in or nested:
                where = "of a placed value" if placed_in else f"inside {nested}"
                self._refuse(eqn, f"is a broadcast {where}", _LOOP_FIX)
            return
        if placed_in and not placed_out:
            if name in ("scan", "while", "cond"):  # A round inside a loop: say so first.
                self._check_placed(eqn, name, ins, outs, nested)
            self._refuse(
                eqn,
                "takes a placed value to a value without the client axis: it selects or mixes "
                "clients outside a reduction",
                "Reduce with reduce_sum / reduce_mean / reduce_weighted_mean instead.",
            )
        if not placed_in:
            # A server value made placed: only a broadcast repeats it for every client.
            if name != "broadcast_in_dim":
                self._refuse(
                    eqn,
                    "makes a per-client value from server values alone, which would differ "
                    "by client index",
                    "Give each client its own data (a client record) instead.",
                )
            return
        self._check_placed(eqn, name, ins, outs, nested)

    def _check_placed(
        self, eqn: Any, name: str, ins: list[int | None], outs: list[int | None], nested: str | None
    ) -> None:
        params = eqn.params
        p = next(a for a in ins if a is not None)
        if name in _PER_CLIENT:
            return
        if name in _CUMULATIVE:
            if params["axis"] == p:
                self._refuse(eqn, f"is a {name} over the client axis", _MIX_FIX)
            return
        if name == "sort":
            if params["dimension"] == p:
                self._refuse(eqn, "sorts along the client axis", _MIX_FIX)
            return
        if name == "reshape":
            self._check_reshape(eqn, p, outs[0])
            return
        if name in ("concatenate", "split"):
            key = "dimension" if name == "concatenate" else "axis"
            if params[key] == p or any(a is None for a in ins):
                self._refuse(eqn, f"{name}s along the client axis", _MIX_FIX)
            return
        if name == "pad":
            if tuple(params["padding_config"][p]) != (0, 0, 0):
                self._refuse(eqn, "pads the client axis", _MIX_FIX)
            return
        if name == "rev":
            if p in params["dimensions"]:
                self._refuse(eqn, "reverses the client axis", _MIX_FIX)
            return
        if name in ("slice", "dynamic_slice", "dynamic_update_slice"):
            # The output keeps the whole client axis (else it lost `n`, refused above); dynamic
            # start indices along it are clamped to 0 by the full-size slice.
            if name == "slice" and (params["strides"] or (1,) * (p + 1))[p] != 1:
                self._refuse(eqn, "strides over the client axis", _MIX_FIX)
            if name == "dynamic_update_slice" and ins[1] is None:
                self._refuse(eqn, "writes one value into every client's slice", _MIX_FIX)
            if any(a is not None for a in ins[1 if name == "dynamic_slice" else 2 :]):
                self._refuse(eqn, "indexes with per-client start indices", _MIX_FIX)
            return
        if name == "gather":
            self._check_gather(eqn, ins)
            return
        if name in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min"):
            self._check_scatter(eqn, ins)
            return
        if name == "scan":
            self._check_scan(eqn, ins)
            return
        if name == "while":
            self._check_body(eqn, eqn.params["cond_jaxpr"], "a while loop's condition")
            self._check_body(eqn, eqn.params["body_jaxpr"], "a while loop")
            return
        if name == "cond":
            if ins[0] is not None:
                self._refuse(eqn, "branches on a per-client index", "Use jnp.where.")
            for branch in params["branches"]:
                self._check_body(eqn, branch, "a cond branch")
            return
        inner = _callee(eqn)
        if inner is not None:
            self._check_body(eqn, inner[0], f"a {name} call")
            return
        self._refuse(
            eqn,
            f"uses {name}, which bridge_mr.beam does not know to keep clients apart",
            "Express the per-client work with other operations, or run the program with jit.",
        )

    def _check_reshape(self, eqn: Any, p: int, q: int | None) -> None:
        if eqn.params.get("dimensions") is not None or q is None:
            self._refuse(eqn, "reshapes across the client axis", _MIX_FIX)
            return
        before_in = int(np.prod(eqn.invars[0].aval.shape[:p], dtype=np.int64))
        before_out = int(np.prod(eqn.outvars[0].aval.shape[:q], dtype=np.int64))
        if before_in != before_out:
            self._refuse(eqn, "reshapes across the client axis", _MIX_FIX)

    def _check_gather(self, eqn: Any, ins: list[int | None]) -> None:
        dims = eqn.params["dimension_numbers"]
        p, q = ins[0], ins[1]
        if p is not None and q is not None:
            batched = list(dims.operand_batching_dims)
            pairs = dict(zip(batched, dims.start_indices_batching_dims, strict=True))
            if pairs.get(p) != q:
                self._refuse(eqn, "gathers across clients", _MIX_FIX)
        elif p is not None and p in dims.start_index_map:
            self._refuse(eqn, "indexes into the client axis", _MIX_FIX)
        elif q is not None and q == eqn.invars[1].aval.ndim - 1:
            self._refuse(eqn, "gathers with the client axis as the index vector", _MIX_FIX)

    def _check_scatter(self, eqn: Any, ins: list[int | None]) -> None:
        dims = eqn.params["dimension_numbers"]
        p, q, u = ins[0], ins[1], ins[2]
        pairs = dict(
            zip(dims.operand_batching_dims, dims.scatter_indices_batching_dims, strict=True)
        )
        if p is None or q is None or u is None or pairs.get(p) != q:
            self._refuse(
                eqn,
                "scatters across clients (e.g. the gradient of a server table indexed by "
                "per-client indices)",
                "Broadcast the table to the clients first (broadcast), so each scatters into "
                "its own copy, and reduce the results.",
            )

    def _check_scan(self, eqn: Any, ins: list[int | None]) -> None:
        start = eqn.params["num_consts"] + eqn.params["num_carry"]
        if any(a == 0 for a in ins[start:]):
            self._refuse(eqn, "scans over the client axis", _MIX_FIX)
        self._check_body(eqn, eqn.params["jaxpr"], "a scan")

    def _check_body(self, eqn: Any, body: Any, where: str) -> None:
        jaxpr = body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body
        for var in jaxpr.invars:
            self.axis(var, eqn)
        for inner in jaxpr.eqns:
            self.check(inner, nested=where)

    def _refuse(self, eqn: Any, why: str, fix: str) -> None:
        raise UnsupportedProgramError(
            f"bridge_mr.beam cannot run this program on Beam: {describe(eqn)} {why}. "
            f"Each {self.placement!r} value must be computed from that client's own data. " + fix
        )


_MIX_FIX = (
    "Per-client work must treat every client alike; combine clients only with reduce_sum / "
    "reduce_mean / reduce_weighted_mean (or run the program with jit)."
)
_LOOP_FIX = (
    "Reductions and broadcasts must be at the program's top level (a Python loop over rounds "
    "is fine; lax.scan / fori_loop over rounds is not): call bridge_mr.beam.run once per round."
)


def _contribution(eqn: Any, checker: _Checker) -> _Contribution | None:
    """The reduction `eqn` is, or None when it is not one (placed in, server out, a sum)."""
    name = eqn.primitive.name
    ins = [checker.axis(a, eqn) for a in eqn.invars]
    outs = [checker.axis(v, eqn) for v in eqn.outvars]
    if any(p is not None for p in outs) or all(p is None for p in ins):
        return None
    if name in ("placed_sum", "placed_mean"):
        kind = "sum" if name == "placed_sum" else "mean"
        return _Contribution(eqn, eqn.invars[0], kind, None, eqn.outvars[0])
    if name == "reduce_sum" and len(eqn.invars) == 1:
        return _reduce_sum_contribution(eqn, ins[0])
    if name == "dot_general" and ins[0] is not None and ins[1] is not None:
        return _dot_contribution(eqn, ins[0], ins[1])
    return None


def _reduce_sum_contribution(eqn: Any, p: int | None) -> _Contribution | None:
    axes = tuple(int(a) for a in eqn.params["axes"])
    if p is None or p not in axes:
        return None
    (x,) = eqn.invars
    rest = tuple(a for a in axes if a != p)

    def step(env: dict[Any, Any]) -> Any:
        value = _read(env, x)
        value = jax.lax.reduce_sum_p.bind(value, axes=rest, out_sharding=None) if rest else value
        return jnp.moveaxis(value, p - sum(a < p for a in rest), 0)

    return _Contribution(eqn, x, "sum", step, eqn.outvars[0])


def _dot_contribution(eqn: Any, p: int, q: int) -> _Contribution | None:
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
        return eqn.primitive.bind(_read(env, lhs), _read(env, rhs), **params)

    return _Contribution(eqn, lhs, "sum", step, eqn.outvars[0])


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


# --- rounds and segments ----------------------------------------------------------------------


@dataclasses.dataclass
class _Round:
    server: list[Any] = dataclasses.field(default_factory=list)
    client: list[Any] = dataclasses.field(default_factory=list)
    reductions: list[_Contribution] = dataclasses.field(default_factory=list)


def split(
    fn: Callable[..., Any],
    server_specs: Sequence[Any],
    record_specs: Sequence[Any],
    *,
    placement: str,
) -> Plan:
    """Traces `fn` with a symbolic client count and splits it into exported segments.

    Args:
        fn: The program: `fn(*server_args, *placed_args)` built with the MapReduce primitives.
        server_specs: One pytree of `jax.ShapeDtypeStruct` per server argument.
        record_specs: One pytree of `jax.ShapeDtypeStruct` per placed argument, for ONE client.
        placement: The placement name `fn`'s primitives use.

    Returns:
        The plan: serialized segments and how they connect.

    Raises:
        UnsupportedProgramError: `fn` cannot run as a MapReduce pipeline (see the class).
    """
    (n,) = jax.export.symbolic_shape("n")
    server_leaves, server_tree = jax.tree.flatten(tuple(server_specs))
    record_leaves, record_tree = jax.tree.flatten(tuple(record_specs))
    placed_leaves = [jax.ShapeDtypeStruct((n, *s.shape), s.dtype) for s in record_leaves]
    num_server = len(server_leaves)

    def flat_fn(*leaves: Any) -> Any:
        server = jax.tree.unflatten(server_tree, leaves[:num_server])
        placed = jax.tree.unflatten(record_tree, leaves[num_server:])
        return fn(*server, *placed)

    traced = jax_core.program(placements={placement: n})(flat_fn)
    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*server_leaves, *placed_leaves)
    flat = _flatten(closed)
    _dce(flat)
    checker = _Checker(n, placement)
    for i, out in enumerate(flat.outvars):
        if placement_axis(out.aval, n, what=lambda: "A result") is not None:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(out_shape)[0][i][0])
            raise UnsupportedProgramError(
                f"The program's result{path} is a placed value ({out.aval.str_short()}): "
                "bridge_mr.beam returns server values only. Reduce it (reduce_sum / "
                "reduce_mean / reduce_weighted_mean), or return the per-client values from "
                "your own Beam transform."
            )
    rounds = _assign_rounds(flat, checker)
    return _build_plan(flat, rounds, n, out_shape, placement, server_tree, record_tree)


def _assign_rounds(flat: _Flat, checker: _Checker) -> list[_Round]:
    round_of: dict[Any, int] = {v: 0 for v in [*flat.invars, *flat.consts]}
    rounds: list[_Round] = [_Round()]
    for eqn in flat.eqns:
        r = max((round_of[v] for v in eqn.invars if isinstance(v, Var)), default=0)
        while len(rounds) <= r + 1:
            rounds.append(_Round())
        contribution = _contribution(eqn, checker)
        if contribution is not None:
            rounds[r].reductions.append(contribution)
            round_of[contribution.result] = r + 1
            continue
        checker.check(eqn)
        placed = any(checker.axis(a, eqn) is not None for a in [*eqn.invars, *eqn.outvars])
        (rounds[r].client if placed else rounds[r].server).append(eqn)
        for v in eqn.outvars:
            round_of[v] = r
    while len(rounds) > 1 and not (rounds[-1].server or rounds[-1].client or rounds[-1].reductions):
        rounds.pop()
    if rounds[-1].reductions:
        rounds.append(_Round())  # server_result, after the last aggregation.
    return rounds


def _uses(eqns: list[Any]) -> set[Any]:
    return {v for eqn in eqns for v in eqn.invars if isinstance(v, Var)}


def _defs(eqns: list[Any]) -> list[Any]:
    return [v for eqn in eqns for v in eqn.outvars]


def _ordered(candidates: list[Any], wanted: set[Any]) -> list[Any]:
    seen: set[Any] = set()
    out = []
    for v in candidates:
        if v in wanted and v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _build_plan(
    flat: _Flat,
    rounds: list[_Round],
    n: Any,
    out_shape: Any,
    placement: str,
    server_tree: Any,
    record_tree: Any,
) -> Plan:
    num_server = server_tree.num_leaves
    server_in = flat.invars[:num_server]
    client_in = flat.invars[num_server:]
    const_vars = list(flat.consts)
    final_uses = {v for v in flat.outvars if isinstance(v, Var)}
    # What each later stage reads: server vars (by server and client segments), placed vars.
    server_needs_after: list[set[Any]] = []  # server vars read at or after round k's clients
    client_needs_after: list[set[Any]] = []  # placed vars read by client segments after round k
    later_server: set[Any] = set(final_uses)
    later_client: set[Any] = set()
    for rnd in reversed(rounds):
        client_reads = (
            _uses(rnd.client) | {c.source for c in rnd.reductions} | _reduction_reads(rnd)
        )
        client_needs_after.append(set(later_client))
        later_client |= client_reads
        server_needs_after.append(later_server | client_reads)
        later_server |= _uses(rnd.server) | client_reads
    server_needs_after.reverse()
    client_needs_after.reverse()

    segments: list[Segment] = []
    reductions: list[list[Reduction]] = []
    env: list[Any] = [*server_in, *const_vars]
    carry: list[Any] = list(client_in)
    reduced: list[Any] = []
    available_server: list[Any] = [*server_in, *const_vars]
    available_client: list[Any] = list(client_in)
    for k, rnd in enumerate(rounds):
        available_server += _defs(rnd.server)
        env_out = _ordered(available_server, server_needs_after[k])
        segments.append(
            _export_segment(
                f"server_{k}", rnd.server, [*env, *reduced], [], env_out, [], n, flat.consts
            )
        )
        env = env_out
        if k == len(rounds) - 1:
            break
        available_client += _defs(rnd.client)
        carry_out = _ordered(available_client, client_needs_after[k])
        steps = [*rnd.client]
        contributions = [c for c in rnd.reductions]
        segments.append(
            _export_segment(
                f"client_{k}", steps, env, carry, carry_out, contributions, n, flat.consts
            )
        )
        reductions.append([_reduction(c) for c in contributions])
        reduced = [c.result for c in contributions]
        available_server += reduced
        carry = carry_out
    outputs: list[tuple[str, Any]] = []
    for v in flat.outvars:
        if isinstance(v, Literal):
            outputs.append(("literal", np.asarray(v.val, dtype=getattr(v.aval, "dtype", None))))
        else:
            outputs.append(("env", env.index(v)))
    return Plan(
        placement=placement,
        segments=segments,
        reductions=reductions,
        outputs=outputs,
        out_tree=jax.tree.structure(out_shape),
        consts=[np.asarray(flat.consts[v]) for v in const_vars],
        server_tree=server_tree,
        record_tree=record_tree,
        record_avals=[(tuple(v.aval.shape[1:]), np.dtype(v.aval.dtype)) for v in client_in],
    )


def _reduction_reads(rnd: _Round) -> set[Any]:
    return {v for c in rnd.reductions for v in c.eqn.invars if isinstance(v, Var)}


def _reduction(c: _Contribution) -> Reduction:
    aval = c.result.aval
    return Reduction(kind=c.kind, shape=tuple(aval.shape), dtype=np.dtype(aval.dtype))


def _export_segment(
    name: str,
    eqns: list[Any],
    server_in: list[Any],
    client_in: list[Any],
    client_out: list[Any],
    contributions: list[_Contribution],
    n: Any,
    consts: dict[Any, Any],
) -> Segment:
    """Exports one segment: f(carrier, *client_in, *server_in) -> (*client_out|env, *contribs).

    Placed inputs and outputs cross with the client axis first (whatever position it has
    inside); server segments (no client_in) return `client_out` as their server outputs.
    """
    axis = {v: placement_axis(v.aval, n, what=lambda: "A value") for v in [*client_in, *client_out]}

    def segment(carrier: Any, *args: Any) -> list[Any]:
        del carrier  # Only its shape: it gives the exported function the client count.
        env: dict[Any, Any] = dict(consts)
        for v, a in zip([*client_in, *server_in], args, strict=True):
            p = axis.get(v)
            env[v] = a if not p else jnp.moveaxis(a, 0, p)
        for eqn in eqns:
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*(_read(env, a) for a in eqn.invars), **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        results = []
        for v in client_out:
            p = axis.get(v)
            results.append(env[v] if not p else jnp.moveaxis(env[v], p, 0))
        for c in contributions:
            results.append(env[c.source] if c.step is None else c.step(env))
        return results

    def spec(v: Any) -> jax.ShapeDtypeStruct:
        shape = list(v.aval.shape)
        p = axis.get(v)
        if p:
            shape.insert(0, shape.pop(p))
        return jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype)

    carrier = jax.ShapeDtypeStruct((n, 0), CARRIER_DTYPE)
    specs = [carrier, *(spec(v) for v in [*client_in, *server_in])]
    exported = jax.export.export(jax.jit(segment))(*specs)
    return Segment(
        name=name,
        serialized=bytes(exported.serialize()),
        num_client_in=len(client_in),
        num_client_out=len(client_out),
        num_contributions=len(contributions),
    )
