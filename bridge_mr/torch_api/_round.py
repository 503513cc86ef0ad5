"""A `map_reduce` round: what it takes (the client function, reductions, strategies, argument
names) and its JAX program, which the torch functions of `_map_reduce` and `_processes` run.

`trace_client` traces the client function once for one client's shapes (what `auto` reads
its cost model from); the round then evaluates that trace wherever it meets the function with
those shapes again (vmap, the loop of per_client, the candidates `auto` times), instead of
running the Python function again. The traces are kept per function key
(`_static.static_key`: by value, or by identity and weakly), shapes, JAX's configuration,
placement and torch's grad mode: a call replays one exactly where the compile cache would
reuse a program of the function, so a function whose globals or captured values were rebound
is traced again; `clear_caches()` drops them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.extend import core
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import _caches, auto, jax_core
from bridge_mr.typing import ClientFn, PyTree, Reduction, Strategy

from ._keys import call_key, trace_key
from ._static import FunctionIdentity, static_key

#: The strategies the torch `map_reduce` offers: the JAX round's and "auto".
STRATEGIES: tuple[str, ...] = ("auto", *jax_core.STRATEGIES)

#: The positional arguments of the round's torch functions, as their errors name them.
ARG_NAMES: tuple[str, ...] = (
    "fn",
    "server",
    "clients",
    "weights",
    "reduce",
    "placement",
    "mesh",
    "strategy",
    "chunk_size",
)
#: The same across processes, where the layout takes the mesh's place.
PROCESS_ARG_NAMES: tuple[str, ...] = (*ARG_NAMES[:6], "layout", *ARG_NAMES[7:])


def map_reduce_jax(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
    strategy: Strategy = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """The JAX program behind `map_reduce` (arguments as there, all positional).

    Returns:
      `bridge_mr.jax_core.map_reduce` of the arguments.
    """
    return jax_core.map_reduce(
        _replaying(fn),
        server,
        clients,
        reduce=reduce,
        weights=weights,
        placement=placement,
        mesh=mesh,
        strategy=strategy,
        chunk_size=chunk_size,
    )


def auto_option(
    args: tuple[Any, ...], budget: int | None, kind: auto.RoundKind
) -> tuple[Strategy, int | None]:
    """The strategy and chunk size `strategy="auto"` runs a round with (`auto.choose`, keyed
    by the round's arguments and `budget`); vmap under `torch.compile` (Dynamo would trace the
    deciding) and for arguments that cannot be keyed (the round's call says why)."""
    if torch.compiler.is_compiling():
        return "vmap", None
    try:
        leaves, treedef = jax.tree_util.tree_flatten((args, budget))
        key, tensors, _ = call_key(leaves, treedef, torch.is_grad_enabled())
        hash(key)
    except (TypeError, ValueError):
        return "vmap", None
    return auto.choose(key, tensors, args, budget, kind)


#: Traces kept per client function (its most recent shapes first out).
_MAX_TRACES_PER_FUNCTION = 8


@dataclasses.dataclass(frozen=True)
class ClientTrace:
    """The client function traced once, for one server value and one client's slice.

    Attributes:
      jaxpr: `fn(server, client)` as a closed jaxpr of the flattened (server, client) leaves.
      out_tree: the structure of `fn`'s result.
    """

    jaxpr: core.ClosedJaxpr
    out_tree: Any


# The traces of each client function, by the function's compile-cache key
# (`_static.static_key`), so a trace is replayed exactly where the compile cache would reuse a
# program of the function: by value (a re-created lambda over the same values replays it; one
# whose globals or captures were rebound has another key), or by identity, weakly.
_MAX_FUNCTIONS = 64
_BY_VALUE: _caches.Bounded[Hashable, _caches.Bounded[Hashable, ClientTrace]]
_BY_VALUE = _caches.register("map_reduce client traces by value", _caches.Bounded(_MAX_FUNCTIONS))
_BY_IDENTITY: _caches.Bounded[int, tuple[weakref.ref[Any], _caches.Bounded[Hashable, ClientTrace]]]
_BY_IDENTITY = _caches.register(
    "map_reduce client traces by identity", _caches.Bounded(_MAX_FUNCTIONS)
)


def _traces_of(fn: ClientFn, *, create: bool) -> _caches.Bounded[Hashable, ClientTrace] | None:
    """The kept traces of `fn` (a new, empty set with `create`), or None.

    Raises:
      TypeError: `fn` has no hashable key (an unhashable callable object).
    """
    key = static_key(fn)
    if isinstance(key, FunctionIdentity):
        found = _BY_IDENTITY.get(id(fn))
        if found is not None and found[0]() is fn:
            return found[1]
        if not create:
            return None
        traces = _caches.Bounded[Hashable, ClientTrace](_MAX_TRACES_PER_FUNCTION)
        _BY_IDENTITY.put(id(fn), (weakref.ref(fn), traces))
        return traces
    kept = _BY_VALUE.get(key)
    if kept is None and create:
        kept = _BY_VALUE.put(key, _caches.Bounded(_MAX_TRACES_PER_FUNCTION))
    return kept


def trace_client(
    fn: ClientFn, server: PyTree, client: PyTree, placement: str, n: int
) -> ClientTrace:
    """Traces `fn` once for `server` and one client's `client` (shapes: `jax.ShapeDtypeStruct`
    leaves) under the round's placement, and keeps the trace for the round to evaluate.

    Args:
      fn: the client function.
      server: the server value's shapes, as the round passes it to `fn`.
      client: one client's slice of the clients' shapes.
      placement: the placement's name.
      n: the client count.

    Returns:
      The trace.

    Raises:
      Whatever tracing `fn` raises.
    """
    with jax_core.program(placements={placement: n}):
        # Through a new function: make_jaxpr keeps traces by the function's equality, and two
        # bound methods of one object are equal after the object changed.
        closed, shape = jax.make_jaxpr(lambda s, c: fn(s, c), return_shape=True)(server, client)
        key = trace_key(jax.tree.structure((server, client)), tuple(closed.in_avals))
    found = ClientTrace(closed, jax.tree.structure(shape))
    try:
        traces = _traces_of(fn, create=True)
    except TypeError:  # Not weakly referable or not hashable: the round traces it itself.
        return found
    assert traces is not None  # Created.
    return traces.put(key, found)


def _replaying(fn: ClientFn) -> ClientFn:
    """`fn`, or what evaluates its kept traces where the shapes match one (see the module)."""
    try:
        traces = _traces_of(fn, create=False)
    except TypeError:
        return fn
    return fn if not traces else _Replay(fn, traces)


class _Replay:
    """The client function, evaluated from its kept trace when one matches the call."""

    def __init__(self, fn: ClientFn, traces: _caches.Bounded[Hashable, ClientTrace]) -> None:
        self._fn = fn
        self._traces = traces

    def __call__(self, server: PyTree, client: PyTree) -> PyTree:
        leaves, tree = jax.tree.flatten((server, client))
        try:
            found = self._traces.get(trace_key(tree, tuple(jax.typeof(x) for x in leaves)))
        except TypeError:  # A leaf JAX has no type for: the function says what it makes of it.
            found = None
        if found is None:
            return self._fn(server, client)
        outs = core.jaxpr_as_fun(found.jaxpr)(*leaves)
        # A constant output comes back as the jaxpr's literal: an array, as `fn` returned it.
        outs = [
            o if isinstance(o, jax.Array) else jnp.asarray(o, aval.dtype)
            for o, aval in zip(outs, found.jaxpr.out_avals, strict=True)
        ]
        return jax.tree.unflatten(found.out_tree, outs)
