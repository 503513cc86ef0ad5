"""Packed values seen unflattened: a linear layer over packed channels, never unpacked.

A CNN's flatten before its first linear layer turns packed activations [N, G·C, H, W]
(`_packed`) into each client's [N, C·H·W]. Unpacking them there splits the packed channels (on
a TPU, two clients' 64 channels share the 128 lanes of a tile) and copies them, twice a local
step with the gradient. The `Lanes` form keeps such a value as it is: a per-client dimension of
size C·H·W (C first) held as the dimensions (G·C, H, W), the first packed. The linear layer's
weights take the same form (their C·H·W dimension held as (G·C, H, W); a scan of local steps
carries them so), and its products are dense products over the packed channels whole: G
copies of the smaller operand, copy g keeping client g's channels and zeros elsewhere (set
with `where`), so each client's result is its own within the rounding of a sum in another
order, for G times the layer's arithmetic. A zero block times another client's infinite weight
is NaN, so, as with the convolutions' zero blocks, a NaN or an infinity spreads within its
chunk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

#: (lhs, rhs, dimension_numbers) -> the equation's product with those dimension numbers.
Bind = Callable[[Any, Any, Any], Any]
#: The form of a value stacked along a new leading client axis (vmap's); `_packed.Form`.
STACKED = -1


@dataclasses.dataclass(frozen=True)
class Lanes:
    """A per-client dimension `dim` of size prod(`sizes`), held as the dimensions `sizes`
    (row-major), the first of them packed: G·sizes[0] long, client g's block the g-th."""

    dim: int
    sizes: tuple[int, ...]


def physical(form: Lanes, logical: int) -> list[int]:
    """The held dimensions of a per-client (logical) dimension."""
    k = len(form.sizes)
    if logical < form.dim:
        return [logical]
    if logical == form.dim:
        return list(range(form.dim, form.dim + k))
    return [logical + k - 1]


def merged(x: Any, form: Lanes) -> Any:
    """`x` packed along `form.dim` (the usual packed form): one reshape."""
    k = len(form.sizes)
    return x.reshape(*x.shape[: form.dim], -1, *x.shape[form.dim + k :])


def packed_dims(ins: Sequence[tuple[Any, Any]]) -> list[int]:
    """The packed dimensions of the operands packed along one (not stacked, not held)."""
    return [f for _, f in ins if isinstance(f, int) and f != STACKED]


def unheld(x: Any, form: int | Lanes | None) -> tuple[Any, int | None]:
    """A value in any form but `Lanes` (a held value merged: packed along its dimension)."""
    return (merged(x, form), form.dim) if isinstance(form, Lanes) else (x, form)


def split(x: Any, form: Lanes) -> Any:
    """`x`, packed along `form.dim`, held in `form`: one reshape."""
    held = (x.shape[form.dim] // math.prod(form.sizes[1:]), *form.sizes[1:])
    return x.reshape(*x.shape[: form.dim], *held, *x.shape[form.dim + 1 :])


def flattening(shape: Sequence[int], dim: int, new_sizes: Sequence[int]) -> Lanes | None:
    """The `Lanes` form of a reshape to `new_sizes` of a per-client `shape` packed along
    `dim` that merges `dim` with the dimensions after it (a flatten), or None."""
    for k in range(2, len(shape) - dim + 1):
        group = tuple(shape[dim : dim + k])
        if tuple(new_sizes) == (*shape[:dim], math.prod(group), *shape[dim + k :]):
            return Lanes(dim, group)
    return None


def unflattening(form: Lanes, shape: Sequence[int], new_sizes: Sequence[int]) -> bool:
    """Whether a reshape of a per-client `shape` held in `form` to `new_sizes` undoes the
    flatten: then the held value is the reshape's, packed along `form.dim`."""
    return tuple(new_sizes) == (*shape[: form.dim], *form.sizes, *shape[form.dim + 1 :])


def transpose(x: Any, form: Lanes, permutation: Sequence[int]) -> tuple[Any, Lanes]:
    """A transpose of a value held in `form`: its held dimensions moved as one."""
    held = [d for p in permutation for d in physical(form, p)]
    return lax.transpose(x, held), Lanes(list(permutation).index(form.dim), form.sizes)


def _mask(g: int, form: Lanes, ndim: int, axis: int) -> Any:
    """[G, ...] (ndim + 1 dimensions): copy g's True where dimension `axis` is client g's."""
    size = form.sizes[0]
    blocks = jnp.arange(g * size) // size == jnp.arange(g)[:, None]
    shape = [1] * (ndim + 1)
    shape[0], shape[axis + 1] = g, g * size
    return blocks.reshape(shape)


def copies(x: Any, form: Lanes, g: int) -> Any:
    """[G, *x.shape]: copy g keeps client g's block of the packed dimension, zeros elsewhere."""
    return jnp.where(_mask(g, form, x.ndim, form.dim), x[None], jnp.zeros((), x.dtype))


def dot_both(bind: Bind, lhs: Any, lhs_form: Lanes, rhs: Any, rhs_form: Lanes, g: int) -> Any:
    """A product contracting exactly the two `Lanes` dimensions: stacked, [G, free...]."""
    lc, rc = physical(lhs_form, lhs_form.dim), physical(rhs_form, rhs_form.dim)
    if lhs.size <= rhs.size:
        held = copies(lhs, lhs_form, g)
        return bind(held, rhs, (([d + 1 for d in lc], rc), ([], [])))
    held = copies(rhs, rhs_form, g)
    out = bind(lhs, held, ((lc, [d + 1 for d in rc]), ([], [])))
    return jnp.moveaxis(out, lhs.ndim - len(lc), 0)


def dot_mixed(
    bind: Bind,
    held: Any,
    form: Lanes,
    stacked: Any,
    contracting: tuple[Sequence[int], Sequence[int]],
    held_is_lhs: bool,
    g: int,
) -> tuple[Any, Lanes]:
    """A product of a value `held` in `form` with a stacked one ([G, ...]), contracting
    `contracting` = (held's per-client dimensions, the stacked one's) and not `form.dim`:
    the result held in `form`'s sizes, each client's block of its own product.

    Either `held`'s copies go in, each keeping one client's block and the clients summed (when
    `held` is the smaller: a layer's input against its output's gradient, for the weights'
    gradient), or every client's product comes out whole and each keeps its own block (a
    layer's weights against its output's gradient, for its input's gradient).
    """
    held_c = [physical(form, d)[0] for d in contracting[0]]
    stacked_c = [d + 1 for d in contracting[1]]
    free = [d for d in range(stacked.ndim) if d not in stacked_c][1:]
    out_size = held.size // math.prod(held.shape[d] for d in held_c)
    out_size *= math.prod(stacked.shape[d] for d in free)
    at = form.dim - sum(d < form.dim for d in contracting[0])  # Among held's free dimensions.
    if not held_is_lhs:
        at += len(free)
    out_form = Lanes(at, form.sizes)
    if held.size <= out_size:
        pieces = copies(held, form, g)
        ours, theirs = [0, *(d + 1 for d in held_c)], [0, *stacked_c]
        if held_is_lhs:
            return bind(pieces, stacked, ((ours, theirs), ([], []))), out_form
        return bind(stacked, pieces, ((theirs, ours), ([], []))), out_form
    if held_is_lhs:
        full = bind(held, stacked, ((held_c, stacked_c), ([], [])))
        full = jnp.moveaxis(full, held.ndim - len(held_c), 0)
    else:
        full = bind(stacked, held, ((stacked_c, held_c), ([], [])))
    mask = _mask(g, out_form, full.ndim - 1, out_form.dim)
    kept = jnp.where(mask, full, jnp.zeros((), full.dtype))
    return kept.sum(0, dtype=full.dtype), out_form  # An integer or bool product keeps its type.


def rule(
    eqn: Any,
    ins: list[tuple[Any, Any]],
    g: int,
    convert: Callable[[Any, Any, Any], Any],
    bind_eqn: Callable[..., list[Any]],
    elementwise: frozenset[str],
) -> list[tuple[Any, Any]] | None:
    """An equation with an operand held in a `Lanes` form, where the result keeps one (a
    reshape that undoes the flatten, a transpose, an elementwise operation, a product); None
    where the held operands are to be merged first.

    `convert(x, form, want)` converts between forms, `bind_eqn(values, **params)` binds the
    equation's primitive with changed parameters.
    """
    name, params = eqn.primitive.name, eqn.params
    forms = [f for _, f in ins]
    held = [f for f in forms if isinstance(f, Lanes)]
    if name == "reshape" and params.get("dimensions") is None:
        if unflattening(forms[0], eqn.invars[0].aval.shape, params["new_sizes"]):
            return [(ins[0][0], forms[0].dim)]
        return None
    if name == "transpose":
        return [transpose(ins[0][0], forms[0], params["permutation"])]
    if name in elementwise:
        if len(set(held)) != 1:
            return None
        values = []
        for atom, (v, f) in zip(eqn.invars, ins, strict=True):
            if f is None and not atom.aval.shape:
                values.append(v)  # A scalar.
            elif tuple(atom.aval.shape) != tuple(eqn.outvars[0].aval.shape):
                return None
            else:
                values.append(convert(v, f, held[0]))
        return [(o, held[0]) for o in bind_eqn(values)]
    if name != "dot_general":
        return None
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if lb or rb:
        return None

    def bind(a: Any, b: Any, numbers: Any) -> Any:
        numbers = tuple(tuple(tuple(d) for d in pair) for pair in numbers)
        return bind_eqn([a, b], dimension_numbers=numbers)[0]

    (lhs, lf), (rhs, rf) = ins
    if isinstance(lf, Lanes) and isinstance(rf, Lanes):
        if tuple(lc) == (lf.dim,) and tuple(rc) == (rf.dim,) and lf.sizes == rf.sizes:
            return [(dot_both(bind, lhs, lf, rhs, rf, g), STACKED)]
        return None
    held_is_lhs = isinstance(lf, Lanes)
    (x, form), (other, other_form) = ins if held_is_lhs else ins[::-1]
    x_c, other_c = (lc, rc) if held_is_lhs else (rc, lc)
    if form.dim not in x_c:
        other = convert(other, other_form, STACKED)
        return [dot_mixed(bind, x, form, other, (x_c, other_c), held_is_lhs, g)]
    if len(x_c) != 1:
        return None
    paired = Lanes(other_c[0], form.sizes)
    other = convert(other, other_form, paired)
    pair = (x, form, other, paired) if held_is_lhs else (other, paired, x, form)
    return [(dot_both(bind, *pair, g), STACKED)]
