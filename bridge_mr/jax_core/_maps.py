"""`placed_map`: `map_fn`'s per-client function kept whole, as one primitive.

`map_fn` normally inlines `jax.vmap(fn)`: the program keeps no trace of the per-client function.
Under `program(..., keep_maps=True)` it binds `placed_map` instead, whose params hold `fn` traced
for one client (`body`, a ClosedJaxpr over flat leaves), so an interpreter of the program
(`bridge_mr.beam`) can run the client work as it is, split at `map_fn`'s boundary.

Params: `body`; `batched` (per input: True = placed, clients first, `body` sees one client's
slice; False = unbatched, `body` sees it whole, as vmap's `in_axes=None`); `placement` and `size`
(an int or a symbolic dimension), as for the other primitives. Every result is placed.

With a concrete size it lowers to the vmap of `body`, so `jit` compiles what `map_fn` compiles
without it; with a symbolic size (`jax.export`), to a loop over the clients. Its JVP is
two maps: the primal one and a tangent one (which recomputes the primal per client); the
transpose is a map of `body`'s transpose per client, whose cotangents of unbatched inputs are
summed with `placed_sum`. Gradients of a program of maps are thus again maps and reductions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir, xla
from jax.sharding import PartitionSpec as P

from ._primitives import placed_sum
from ._program import Size

map_p = jex_core.Primitive("placed_map")
map_p.multiple_results = True
map_p.def_impl(functools.partial(xla.apply_primitive, map_p))


def placed_map(
    body: jex_core.ClosedJaxpr,
    *args: Any,
    batched: Sequence[bool],
    placement: str,
    size: Size,
) -> list[Any]:
    """Binds `placed_map`: `body` applied to every placed slice of `args`."""
    return map_p.bind(*args, body=body, batched=tuple(batched), placement=placement, size=size)


def _client_specs(avals: Sequence[Any], batched: Sequence[bool]) -> list[jax.ShapeDtypeStruct]:
    """What `body` sees of each input: one client's slice of a placed one, an unbatched whole."""
    return [
        jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype, weak_type=a.weak_type)
        for a, b in zip(avals, batched, strict=True)
    ]


def _trace(fn: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct]) -> jex_core.ClosedJaxpr:
    return jax.make_jaxpr(fn)(*specs)


def _pick(flags: Sequence[bool], values: Sequence[Any]) -> list[Any]:
    return [v for f, v in zip(flags, values, strict=True) if f]


def _merge(flags: Sequence[bool], chosen: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """The inverse of `_pick`: `chosen` where `flags`, `others` elsewhere, in order."""
    it_chosen, it_others = iter(chosen), iter(others)
    return [next(it_chosen) if f else next(it_others) for f in flags]


def trace_map(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    in_axes: tuple[Any, ...],
    placement: str,
    size: Size,
) -> Any:
    """`map_fn`'s result as one `placed_map`: `fn` traced once, for one client.

    Args:
        fn: The per-client function.
        args: Its arguments, placed leaves with the clients first.
        in_axes: As for `jax.vmap`, one 0 (placed) or None (unbatched) per leaf of `args`.
        placement: The placement's name.
        size: The placement's size.

    Returns:
        `fn`'s results for every client, stacked along a leading placement axis.
    """
    leaves, in_tree = jax.tree.flatten(args)
    batched = [axis == 0 for axis in jax.tree.leaves(in_axes, is_leaf=lambda x: x is None)]
    traced, out_shape = jax.make_jaxpr(
        lambda *flat: fn(*jax.tree.unflatten(in_tree, flat)), return_shape=True
    )(*_client_specs([jax.typeof(x) for x in leaves], batched))
    body, hoisted = _hoist_tracers(traced)
    outs = placed_map(
        body,
        *leaves,
        *hoisted,
        batched=[*batched, *([False] * len(hoisted))],
        placement=placement,
        size=size,
    )
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _hoist_tracers(closed: jex_core.ClosedJaxpr) -> tuple[jex_core.ClosedJaxpr, list[Any]]:
    """Values of the enclosing trace that `fn` closes over, made unbatched inputs of `body`.

    A closure sees such a value whole, as under vmap (a round's learning rate, a key). Left as
    constants, they would leak the enclosing trace's tracers into `body`.
    """
    jaxpr, consts = closed.jaxpr, closed.consts
    hoist = [isinstance(c, Tracer) for c in consts]
    keep = [not h for h in hoist]
    new = jaxpr.replace(
        constvars=_pick(keep, jaxpr.constvars),
        invars=[*jaxpr.invars, *_pick(hoist, jaxpr.constvars)],
    )
    return jex_core.ClosedJaxpr(new, _pick(keep, consts)), _pick(hoist, consts)


def _abstract_eval(*avals: Any, body: Any, batched: Any, placement: str, size: Size) -> Any:
    del avals, batched, placement  # Unused.
    placed = [
        a.update(shape=(size, *a.shape), sharding=a.sharding.update(spec=P(None, *a.sharding.spec)))
        for a in body.out_avals
    ]
    return placed, body.effects


map_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(*args: Any, body: Any, batched: Any, placement: str, size: Size) -> Any:
    del placement  # Unused.
    fn = jex_core.jaxpr_as_fun(body)
    if isinstance(size, int):
        return jax.vmap(fn, in_axes=tuple(0 if b else None for b in batched), axis_size=size)(*args)
    # A symbolic client count (jax.export, bridge_mr.beam's segments): vmap would make a
    # per-client convolution one grouped by `size`, which XLA cannot compile; loop instead.

    def step(i: Any, outs: list[Any]) -> list[Any]:
        client = [
            jax.lax.dynamic_index_in_dim(x, i, keepdims=False) if b else x
            for x, b in zip(args, batched, strict=True)
        ]
        return [
            jax.lax.dynamic_update_index_in_dim(o, r, i, 0)
            for o, r in zip(outs, fn(*client), strict=True)
        ]

    init = [jnp.zeros((size, *a.shape), a.dtype) for a in body.out_avals]
    return jax.lax.fori_loop(0, jnp.asarray(size, jnp.int32), step, init)


mlir.register_lowering(map_p, mlir.lower_fun(_lowering, multiple_results=True))


def _batch(
    args: Any, dims: Any, *, body: Any, batched: Any, placement: str, size: Size
) -> tuple[list[Any], list[int]]:
    # The outer vmap's axis goes right after the clients (placed inputs) or first (unbatched
    # ones); the body becomes the vmap of `body` over it.
    moved = [
        x if d is None else jnp.moveaxis(x, d, 1 if b else 0)
        for x, d, b in zip(args, dims, batched, strict=True)
    ]
    outer = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    inner = tuple(None if d is None else 0 for d in dims)
    fn = jax.vmap(jex_core.jaxpr_as_fun(body), in_axes=inner, axis_size=outer)
    new_body = _trace(fn, _client_specs([jax.typeof(x) for x in moved], batched))
    outs = placed_map(new_body, *moved, batched=batched, placement=placement, size=size)
    return outs, [1] * len(outs)


batching.primitive_batchers[map_p] = _batch


def _jvp(
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    body: Any,
    batched: Any,
    placement: str,
    size: Size,
) -> tuple[list[Any], list[Any]]:
    # Two maps: the primal one (known under linearize, so later primal work and residuals come
    # from it) and the tangent one, of the inputs with nonzero tangents, which recomputes the
    # primal per client.
    nonzero = [
        type(t) is not ad.Zero and jax.typeof(t).dtype != jax.dtypes.float0 for t in tangents
    ]
    fun = jex_core.jaxpr_as_fun(body)

    def tangent_body(*args: Any) -> Any:
        ps, ts = args[: len(primals)], args[len(primals) :]

        def of_differentiated(*xs: Any) -> Any:
            return fun(*_merge(nonzero, xs, _pick([not nz for nz in nonzero], ps)))

        return jax.jvp(of_differentiated, tuple(_pick(nonzero, ps)), tuple(ts))[1]

    tangents_in = _pick(nonzero, tangents)
    tangent_batched = _pick(nonzero, batched)
    specs = _client_specs(
        [jax.typeof(x) for x in [*primals, *tangents_in]], [*batched, *tangent_batched]
    )
    jvp_body = _trace(tangent_body, specs)
    primal_out = placed_map(body, *primals, batched=batched, placement=placement, size=size)
    # Results without a tangent (integers: float0) stay symbolic zeros, out of the tangent map.
    has_tangent = [a.dtype != jax.dtypes.float0 for a in jvp_body.out_avals]
    zeros = [ad.Zero(jax.typeof(p).to_tangent_aval()) for p in primal_out]
    if not any(has_tangent):
        return primal_out, zeros
    jvp_body = _drop_outputs(jvp_body, has_tangent)
    tangent_out = placed_map(
        jvp_body,
        *primals,
        *tangents_in,
        batched=(*batched, *tangent_batched),
        placement=placement,
        size=size,
    )
    return primal_out, _merge(has_tangent, tangent_out, _pick([not t for t in has_tangent], zeros))


ad.primitive_jvps[map_p] = _jvp


def _drop_outputs(closed: jex_core.ClosedJaxpr, keep: Sequence[bool]) -> jex_core.ClosedJaxpr:
    jaxpr = closed.jaxpr
    return jex_core.ClosedJaxpr(jaxpr.replace(outvars=_pick(keep, jaxpr.outvars)), closed.consts)


def _transpose(
    cts: Sequence[Any], *args: Any, body: Any, batched: Any, placement: str, size: Size
) -> list[Any]:
    # Per client, `body`'s transpose in its linear inputs; an unbatched input's cotangents are
    # then summed over the clients.
    linear = [ad.is_undefined_primal(x) for x in args]
    known_flags = [not lin for lin in linear]
    avals = [x.aval if lin else jax.typeof(x) for x, lin in zip(args, linear, strict=True)]
    specs = _client_specs(avals, batched)
    known = _pick(known_flags, args)
    cts = [ad.instantiate_zeros(c) for c in cts]
    fun = jex_core.jaxpr_as_fun(body)

    def transposed(*known_and_cts: Any) -> Any:
        ks, cs = known_and_cts[: len(known)], known_and_cts[len(known) :]

        def linear_part(*lin: Any) -> Any:
            return fun(*_merge(linear, lin, ks))

        zeros = [jnp.zeros(s.shape, s.dtype) for s in _pick(linear, specs)]
        # Transposed, not differentiated: a custom_vjp's tangent body holds custom_lin, which
        # can only be transposed.
        return jax.linear_transpose(linear_part, *zeros)(list(cs))

    ct_specs = _client_specs([jax.typeof(c) for c in cts], [True] * len(cts))
    body_t = _trace(transposed, [*_pick(known_flags, specs), *ct_specs])
    per_client = placed_map(
        body_t,
        *known,
        *cts,
        batched=(*_pick(known_flags, batched), *([True] * len(cts))),
        placement=placement,
        size=size,
    )
    summed = [
        ct if b else placed_sum(ct, placement=placement, size=size, mesh=None)
        for ct, b in zip(per_client, _pick(linear, batched), strict=True)
    ]
    return _merge(linear, summed, [None] * len(known))


ad.primitive_transposes[map_p] = _transpose
