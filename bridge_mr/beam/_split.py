"""Splits a MapReduce program's jaxpr into the phases of TFF's DistributeAggregateForm.

The program is traced with a symbolic client count `n`. A value is *placed* when its type has
the dimension `n` (its placement axis, which `vmap` inside `map_fn` may have moved off the front);
every other value is a *server* value. Equations then fall into three kinds (`_rules` says which
is which, primitive by primitive):

* server equations: no placed input or output (they run once, on one worker);
* client equations: a placed input or output, checked to keep clients apart — each client's
  slice of an output depends only on that client's slices of the inputs and on server values
  (they run per client: on any bundle of clients, since they are independent);
* reductions: a placed input and a server output that is a sum over the placement axis
  (`placed_sum`, `placed_mean`, and the `reduce_sum` / `dot_general` contractions over the
  placement axis that JAX's own gradients of `vmap` produce). Each becomes a per-client
  contribution and a sum in the CombineFn.

Anything else that takes placed values to server values, or that reads the client index, is
refused, naming the equation. Rounds: a reduction's result is one round later than its
input; round k is server_prepare (server equations of round k), the broadcast of its values (a
side input), client_work (client equations of round k), client_to_server_aggregation (its
reductions), and the last server segment is server_result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bridge_mr import jax_core

from ._jaxpr import Flat, Literal, Var, dce, defs, flatten, ordered, read, uses
from ._plan import Aggregation, Plan, Segment
from ._reductions import Contribution, contribution
from ._rules import Checker, UnsupportedProgramError, placement_axis

#: Exported segments' calling convention: argument 0 carries the client count as its leading
#: dimension (a float32[n, 0] array, empty), so every segment can solve `n` from its inputs.
CARRIER_DTYPE = np.float32


@dataclasses.dataclass
class _RoundEquations:
    server: list[Any] = dataclasses.field(default_factory=list)
    client: list[Any] = dataclasses.field(default_factory=list)
    reductions: list[Contribution] = dataclasses.field(default_factory=list)


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

    # keep_maps: each map_fn stays one `placed_map` holding its per-client function.
    traced = jax_core.program(placements={placement: n}, keep_maps=True)(flat_fn)
    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*server_leaves, *placed_leaves)
    flat = flatten(closed)
    dce(flat)
    checker = Checker(n, placement)
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


def _assign_rounds(flat: Flat, checker: Checker) -> list[_RoundEquations]:
    round_of: dict[Any, int] = {v: 0 for v in [*flat.invars, *flat.consts]}
    rounds: list[_RoundEquations] = [_RoundEquations()]
    for eqn in flat.eqns:
        r = max((round_of[v] for v in eqn.invars if isinstance(v, Var)), default=0)
        while len(rounds) <= r + 1:
            rounds.append(_RoundEquations())
        reduction = contribution(eqn, checker)
        if reduction is not None:
            rounds[r].reductions.append(reduction)
            round_of[reduction.result] = r + 1
            continue
        checker.check(eqn)
        placed = any(checker.axis(a, eqn) is not None for a in [*eqn.invars, *eqn.outvars])
        (rounds[r].client if placed else rounds[r].server).append(eqn)
        for v in eqn.outvars:
            round_of[v] = r
    while len(rounds) > 1 and not (rounds[-1].server or rounds[-1].client or rounds[-1].reductions):
        rounds.pop()
    if rounds[-1].reductions:
        rounds.append(_RoundEquations())  # server_result, after the last aggregation.
    return rounds


def _build_plan(
    flat: Flat,
    rounds: list[_RoundEquations],
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
        client_reads = uses(rnd.client) | {c.source for c in rnd.reductions} | _reduction_reads(rnd)
        client_needs_after.append(set(later_client))
        later_client |= client_reads
        server_needs_after.append(later_server | client_reads)
        later_server |= uses(rnd.server) | client_reads
    server_needs_after.reverse()
    client_needs_after.reverse()

    segments: list[Segment] = []
    aggregations: list[list[Aggregation]] = []
    env: list[Any] = [*server_in, *const_vars]
    carry: list[Any] = list(client_in)
    reduced: list[Any] = []
    available_server: list[Any] = [*server_in, *const_vars]
    available_client: list[Any] = list(client_in)
    for k, rnd in enumerate(rounds):
        available_server += defs(rnd.server)
        env_out = ordered(available_server, server_needs_after[k])
        segments.append(
            _export_segment(
                f"server_{k}", rnd.server, [*env, *reduced], [], env_out, [], n, flat.consts
            )
        )
        env = env_out
        if k == len(rounds) - 1:
            break
        available_client += defs(rnd.client)
        carry_out = ordered(available_client, client_needs_after[k])
        steps = [*rnd.client]
        contributions = [c for c in rnd.reductions]
        segments.append(
            _export_segment(
                f"client_{k}", steps, env, carry, carry_out, contributions, n, flat.consts
            )
        )
        aggregations.append([_aggregation(c) for c in contributions])
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
        aggregations=aggregations,
        outputs=outputs,
        out_tree=jax.tree.structure(out_shape),
        consts=[np.asarray(flat.consts[v]) for v in const_vars],
        server_tree=server_tree,
        record_tree=record_tree,
        record_avals=[(tuple(v.aval.shape[1:]), np.dtype(v.aval.dtype)) for v in client_in],
    )


def _reduction_reads(rnd: _RoundEquations) -> set[Any]:
    return {v for c in rnd.reductions for v in c.eqn.invars if isinstance(v, Var)}


def _aggregation(c: Contribution) -> Aggregation:
    aval = c.result.aval
    return Aggregation(kind=c.kind, shape=tuple(aval.shape), dtype=np.dtype(aval.dtype))


def _export_segment(
    name: str,
    eqns: list[Any],
    server_in: list[Any],
    client_in: list[Any],
    client_out: list[Any],
    contributions: list[Contribution],
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
            ins = [read(env, a) for a in eqn.invars]
            # A placed_map (symbolic n) lowers to a loop over the bundle's clients.
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
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
