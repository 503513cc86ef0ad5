"""G clients packed into their channels: `jax.vmap` whose convolutions run as dense ones.

`vmap_packed(fn)` computes `jax.vmap(fn)` (every argument batched along its leading axis, the
clients of one chunk) by evaluating `fn`'s traced program with each value in one of three
forms: the same for every client (unbatched), stacked along a new leading axis (vmap's form),
or *packed*: the clients merged, client-major, into one of the value's own dimensions (client
g's channel c is channel g·C + c). A convolution whose input is packed into its features and
whose kernel is per client runs as one dense convolution of the block-diagonal kernel; its
kernel gradient as one dense convolution whose diagonal blocks are kept; with a kernel every
client shares, the clients go side by side in the batch. Elementwise operations,
broadcasts, transposes, reductions and windows (max-pools and their gradients) that leave the
packed dimension alone keep values packed, so a CNN's activations stay packed from one layer to
the next, in the layout a TPU's matrix unit takes. A flatten of packed activations keeps them
as they are (`_lanes.Lanes`), and the linear layer after it runs as dense products over the
packed channels, its weights carried in the same form from one local step to the next; everything
else (other matrix products) runs as vmap runs it, on the stacked form. On a TPU a max-pool
whose windows tile its input runs as a reshape and a max (`_windows`), and at "highest" a
convolution of images (few features) as a product of its patches (`_patched`).

The dense convolutions do G times the arithmetic of the clients' own (the zero blocks), in G
times fewer and wider products: a CNN's 3 to 64 channels leave most of a TPU v5e's 128 lanes
idle; two clients at a time measured faster than one (docs/performance.md). The zero blocks
add exact zeros, so each client's values are its own within the rounding of a sum in another
order; but a NaN or an infinity in one client's activations turns the products with its zero
blocks into NaN, so it spreads to the other clients of its chunk.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

from . import _lanes
from ._blocks import block_diagonal, diagonal_blocks
from ._cpu import has_convolution
from ._lanes import STACKED, Lanes
from ._patched import convolution as patched_convolution
from ._rewrite import rebind
from ._windows import lowering

F = TypeVar("F", bound=Callable[..., Any])

#: A value's form: None (unbatched), STACKED (a leading client axis), the packed dimension, or
#: a flattened packed dimension held unflattened (`Lanes`).
Form = int | Lanes | None

_ELEMENTWISE_NAMES = """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor
ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
population_count pow reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
real shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor"""
_ELEMENTWISE = frozenset(_ELEMENTWISE_NAMES.split())
_REDUCTION_NAMES = "argmax argmin reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum"
_REDUCTIONS = frozenset(_REDUCTION_NAMES.split())
_WINDOWS = frozenset(["reduce_window_max", "reduce_window_min", "reduce_window_sum"])
#: The call primitives whose program (in the named parameter) is evaluated in place.
_INLINED = types.MappingProxyType({"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr"})


def vmap_packed(fn: F, size: int) -> F:
    """`jax.vmap(fn)` over `size` clients, their convolutions packed (see the module).

    Args:
      fn: a JAX function of positional pytree arguments (one client's).
      size: the number of clients: every argument leaf's leading axis.

    Returns:
      A function of the stacked arguments whose results are `jax.vmap(fn)(*args)`'s.

    Raises:
      ValueError: (when called) an argument leaf whose leading axis is not `size` long.

    Example:
      >>> def conv(k, x):
      ...     return jax.lax.conv(x, k, (1, 1), "SAME").sum()
      >>> k, x = jnp.ones((2, 4, 3, 3, 3)), jnp.ones((2, 5, 3, 8, 8))
      >>> bridge_mr.jax_core.vmap_packed(conv, 2)(k, x)  # jax.vmap(conv)(k, x)
      Array([29040., 29040.], dtype=float32)
    """

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args):
            if not jnp.shape(leaf)[:1] == (size,):
                raise ValueError(
                    f"vmap_packed(fn, {size}): every argument leaf needs a leading axis of the "
                    f"{size} clients; args{jax.tree_util.keystr(path)} has shape "
                    f"{jnp.shape(leaf)}. Stack each client's value along a new first axis."
                )
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), args)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*one)
        if not has_convolution(closed.jaxpr):
            return jax.vmap(fn)(*args)
        leaves = [(jnp.asarray(x), STACKED) for x in jax.tree.leaves(args)]
        packing = _Packing(size)
        outs = packing.eval(closed.jaxpr, closed.consts, leaves)
        stacked = [packing.convert(v, f, STACKED) for v, f in outs]
        return jax.tree.unflatten(jax.tree.structure(out_shape), stacked)

    return run  # type: ignore[return-value]


class _Packing:
    """One evaluation of a program for `size` clients; values are (array, form) pairs."""

    def __init__(self, size: int) -> None:
        self.size = size

    def eval(
        self, jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]]:
        env: dict[core.Var, tuple[Any, Form]] = {}

        def read(atom: Any) -> tuple[Any, Form]:
            if isinstance(atom, core.Literal):  # An array: a scan's carry may start as one.
                return jnp.asarray(atom.val, _aval(atom).dtype), None
            return env[atom]

        env.update((v, (c, None)) for v, c in zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            if all(f is None for _, f in ins):
                outs: list[tuple[Any, Form]] = [(o, None) for o in rebind(eqn, [v for v, _ in ins])]
            else:
                outs = self.rule(eqn, ins)
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, core.DropVar):
                    env[var] = out
        return [read(a) for a in jaxpr.outvars]

    def rule(self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]) -> list[tuple[Any, Form]]:
        name = eqn.primitive.name
        out: list[tuple[Any, Form]] | None = None
        if name not in (*_INLINED, "scan", "custom_jvp_call") and any(
            isinstance(f, Lanes) for _, f in ins
        ):
            bind = functools.partial(rebind, eqn)
            out = _lanes.rule(eqn, ins, self.size, self.convert, bind, _ELEMENTWISE)
            if out is not None:
                return out
            ins = [_lanes.unheld(v, f) for v, f in ins]
        if name in _ELEMENTWISE:
            out = self.elementwise(eqn, ins)
        elif name == "conv_general_dilated":
            out = self.convolution(eqn, ins)
        elif name in _INLINED:
            closed = eqn.params[_INLINED[name]]
            out = self.eval(closed.jaxpr, closed.consts, ins)
        elif name == "scan":
            out = self.scan(eqn, ins)
        elif name == "custom_jvp_call":
            out = self.custom_jvp(eqn, ins)
        elif name == "dot_general":
            out = self.dot(eqn, ins)
        elif name == "reduce_window":
            out = self.reduce_window(eqn, ins)
        elif len(ins) == 1 or name in ("select_and_gather_add", "select_and_scatter_add", "pad"):
            out = self.structural(eqn, ins)
        return self.vmapped(eqn, ins) if out is None else out

    # Conversions between forms.

    def convert(self, x: Any, form: Form, want: Form) -> Any:
        """`x` (in `form`) in the form `want`."""
        if form == want:
            return x
        x, form = _lanes.unheld(x, form)
        if form == want:  # A held value wanted packed along its own dimension.
            return x
        if isinstance(want, Lanes):
            return _lanes.split(self.convert(x, form, want.dim), want)
        g = self.size
        if form is not None and form != STACKED:  # Unpack: (.., G·C, ..) -> (G, .., C, ..).
            shape = (*x.shape[:form], g, x.shape[form] // g, *x.shape[form + 1 :])
            x, form = jnp.moveaxis(x.reshape(shape), form, 0), STACKED
        if want == STACKED:
            return jnp.broadcast_to(x, (g, *x.shape)) if form is None else x
        assert want is not None, "nothing converts a batched value to an unbatched one"
        if form is None:  # Every client's copy side by side: a broadcast, no transpose.
            dims = [d if d < want else d + 1 for d in range(x.ndim)]
            x = lax.broadcast_in_dim(x, (*x.shape[:want], g, *x.shape[want:]), dims)
        else:
            x = jnp.moveaxis(x, 0, want)
        return x.reshape(*x.shape[:want], g * x.shape[want + 1], *x.shape[want + 2 :])

    def vmapped(self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]) -> list[tuple[Any, Form]]:
        """The equation as `jax.vmap` runs it, on the stacked form (the fallback)."""
        axes = [None if f is None else 0 for _, f in ins]
        values = [v if f is None else self.convert(v, f, STACKED) for v, f in ins]
        outs = jax.vmap(lambda *a: rebind(eqn, a), in_axes=axes, axis_size=self.size)(*values)
        return [(o, STACKED) for o in outs]

    # Rules: each returns None where the equation runs as vmap runs it.

    def elementwise(
        self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]] | None:
        """Elementwise (operands the output's shape, scalars, or with dimensions of 1)."""
        packed = _lanes.packed_dims(ins)
        shape = _aval(eqn.outvars[0]).shape
        if not packed or any(len(_aval(a).shape) not in (0, len(shape)) for a in eqn.invars):
            return None
        dim = max(set(packed), key=packed.count)
        values = []
        for atom, (v, f) in zip(eqn.invars, ins, strict=True):
            own = _aval(atom).shape
            if f is None and (not own or own[dim] == 1):
                values.append(v)  # Broadcasts over every client's channels as it is.
                continue
            if f is not None and (not own or own[dim] != shape[dim]):
                # Per client but broadcast along the packed dimension: made full along it.
                v = self.convert(v, f, STACKED)
                v = v.reshape(v.shape[:1] + (1,) * (len(shape) - len(own)) + v.shape[1:])
                sizes = [self.size, *(v.shape[1:])]
                sizes[1 + dim] = shape[dim]
                v, f = jnp.broadcast_to(v, sizes), STACKED
            values.append(self.convert(v, f, dim))
        return [(o, dim) for o in rebind(eqn, values)]

    def custom_jvp(
        self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]] | None:
        """A `jax.custom_jvp` function evaluated packed, its JVP rule run as vmap runs it."""
        if not all(jnp.issubdtype(_aval(a).dtype, jnp.inexact) for a in eqn.invars):
            return None
        closed: core.ClosedJaxpr = eqn.params["call_jaxpr"]
        forms = [f for _, f in ins]
        out_forms: list[Form] = []

        def primal(*values: Any) -> list[Any]:
            outs = self.eval(closed.jaxpr, closed.consts, list(zip(values, forms, strict=True)))
            out_forms[:] = [f for _, f in outs]
            return [v for v, _ in outs]

        call = jax.custom_jvp(primal)

        @call.defjvp
        def _jvp(primals: Any, tangents: Any) -> Any:
            if not out_forms:  # Differentiated first (jax.grad of the whole): the forms' trace.
                jax.eval_shape(primal, *primals)
            axes = [None if f is None else 0 for f in forms]
            stacked = [
                [
                    v if f is None else self.convert(v, f, STACKED)
                    for v, f in zip(vs, forms, strict=True)
                ]
                for vs in (primals, tangents)
            ]
            outs, out_tangents = jax.vmap(
                lambda p, t: jax.jvp(lambda *a: rebind(eqn, a), p, t),
                in_axes=(axes, axes),
                axis_size=self.size,
            )(*stacked)
            return (
                [
                    self.convert(o, STACKED, f) if f is not None else o[0]
                    for o, f in zip(outs, out_forms, strict=True)
                ],
                [
                    self.convert(o, STACKED, f) if f is not None else o[0]
                    for o, f in zip(out_tangents, out_forms, strict=True)
                ],
            )

        outs = call(*[v for v, _ in ins])
        return list(zip(outs, out_forms, strict=True))

    def reduce_window(
        self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]] | None:
        """A reduction over windows of several operands (e.g. a max-pool with its indices)."""
        n = len(ins) // 2
        packed = _lanes.packed_dims(ins[:n])
        if not packed or any(f is not None for _, f in ins[n:]):
            return None
        dim = packed[0]
        if not _window_leaves(eqn.params, dim):
            return None
        values = [self.convert(v, f, dim) for v, f in ins[:n]] + [v for v, _ in ins[n:]]
        return [(o, dim) for o in rebind(eqn, values)]

    def structural(
        self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]] | None:
        """Operations along other dimensions than the packed one: it stays packed."""
        packed = _lanes.packed_dims(ins)
        if not packed:
            return None
        dim = packed[0]
        name, params = eqn.primitive.name, eqn.params
        shape = _aval(eqn.invars[0]).shape
        g = self.size
        if name == "pad":
            if ins[0][1] != dim or tuple(params["padding_config"][dim]) != (0, 0, 0):
                return None
            return [(rebind(eqn, [ins[0][0], ins[1][0]])[0], dim)]
        if name == "transpose":
            return [(rebind(eqn, [ins[0][0]])[0], list(params["permutation"]).index(dim))]
        if name in _REDUCTIONS and dim not in params["axes"]:
            new = dim - sum(int(a) < dim for a in params["axes"])
            return [(rebind(eqn, [ins[0][0]])[0], new)]
        if name == "squeeze" and dim not in params["dimensions"]:
            new = dim - sum(int(a) < dim for a in params["dimensions"])
            return [(rebind(eqn, [ins[0][0]])[0], new)]
        if name == "reshape" and params.get("dimensions") is None:
            new_sizes = tuple(params["new_sizes"])
            for d in range(len(new_sizes)):
                if new_sizes[d] == shape[dim] and math.prod(new_sizes[:d]) == math.prod(
                    shape[:dim]
                ):
                    sizes = (*new_sizes[:d], g * new_sizes[d], *new_sizes[d + 1 :])
                    return [(rebind(eqn, [ins[0][0]], new_sizes=sizes)[0], d)]
            held = _lanes.flattening(shape, dim, new_sizes)  # Kept as it is.
            return None if held is None else [(ins[0][0], held)]
        if name == "broadcast_in_dim":
            target = params["broadcast_dimensions"][dim]
            if params["shape"][target] != shape[dim]:
                return None
            sizes = list(params["shape"])
            sizes[target] *= g
            return [(rebind(eqn, [ins[0][0]], shape=tuple(sizes))[0], target)]
        if name == "rev" and dim not in params["dimensions"]:
            return [(rebind(eqn, [ins[0][0]])[0], dim)]
        if name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
            return [(rebind(eqn, [ins[0][0]])[0], dim)] if params["axis"] != dim else None
        windowed = name in _WINDOWS or name in ("select_and_gather_add", "select_and_scatter_add")
        if not windowed or not _window_leaves(params, dim):
            return None
        values = [self.convert(v, f, dim) for v, f in ins]
        return [(_bind_window(eqn, values), dim)]

    def convolution(
        self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]
    ) -> list[tuple[Any, Form]] | None:
        (lhs, lhs_form), (rhs, rhs_form) = ins
        params = eqn.params
        lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
        groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
        g = self.size
        if lhs_form is not None and rhs_form is None and lhs_form in (STACKED, lhs_spec[0]):
            if batch_groups != 1:
                return None
            # A kernel every client shares: the clients side by side in the batch.
            out = rebind(eqn, [self.convert(lhs, lhs_form, lhs_spec[0]), rhs])[0]
            return [(out, out_spec[0])]
        if lhs_form is not None and rhs_form in (None, STACKED):
            if batch_groups != 1 or (rhs_form is None and lhs_form != lhs_spec[1]):
                return None
            # Per-client kernels on inputs packed into their features: the block-diagonal
            # kernel (or, for grouped convolutions, the clients' groups side by side).
            lhs = self.convert(lhs, lhs_form, lhs_spec[1])
            rhs = self.convert(rhs, rhs_form, STACKED)
            if groups == 1:
                kernel, groups_ = block_diagonal(rhs, rhs_spec[0], rhs_spec[1]), 1
            else:
                kernel, groups_ = self.convert(rhs, STACKED, rhs_spec[0]), g * groups
            out = patched_convolution(eqn, lhs, kernel, lhs_spec[1], g, feature_group_count=groups_)
            return [(out, out_spec[1])]
        if rhs_form is None or rhs_form == STACKED or groups != 1 or batch_groups != 1:
            return None
        # A kernel's gradient (the inputs' features against the output gradients' features):
        # every pair of clients in one dense product, client g's the diagonal block (g, g).
        lhs = self.convert(lhs, lhs_form, lhs_spec[0])
        rhs = self.convert(rhs, rhs_form, rhs_spec[0])
        full = patched_convolution(eqn, lhs, rhs, lhs_spec[0], g)
        return [(diagonal_blocks(full, out_spec[0], out_spec[1], g), STACKED)]

    def dot(self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]) -> list[tuple[Any, Form]] | None:
        """A product of a value packed along a free dimension with an unbatched one."""
        ((lhs_c, rhs_c), (lhs_b, rhs_b)) = eqn.params["dimension_numbers"]
        (lhs, lhs_form), (rhs, rhs_form) = ins
        ranks = [len(_aval(a).shape) for a in eqn.invars]
        free = [
            [d for d in range(rank) if d not in (*c, *b)]
            for rank, c, b in zip(ranks, (lhs_c, rhs_c), (lhs_b, rhs_b), strict=True)
        ]
        if rhs_form is None and isinstance(lhs_form, int) and lhs_form in free[0]:
            return [(rebind(eqn, [lhs, rhs])[0], len(lhs_b) + free[0].index(lhs_form))]
        if lhs_form is None and isinstance(rhs_form, int) and rhs_form in free[1]:
            at = len(lhs_b) + len(free[0]) + free[1].index(rhs_form)
            return [(rebind(eqn, [lhs, rhs])[0], at)]
        return None

    def scan(self, eqn: core.JaxprEqn, ins: list[tuple[Any, Form]]) -> list[tuple[Any, Form]]:
        """A scan whose body runs packed; its carries keep one form from step to step."""
        p = eqn.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        body: core.ClosedJaxpr = p["jaxpr"]
        consts, init = ins[:n_consts], ins[n_consts : n_consts + n_carry]
        # A value packed along the scanned axis is unpacked; along another, its steps are.
        xs = []
        for v, f in (_lanes.unheld(v, f) for v, f in ins[n_consts + n_carry :]):
            xs.append((self.convert(v, 0, STACKED), STACKED) if f == 0 else (v, f))
        x_forms: list[Form] = [f if f is None or f == STACKED else f - 1 for _, f in xs]
        carry_forms: list[Form] = [f for _, f in init]
        y_forms: list[int | None] = []

        def run_body(carry: list[Any], x: list[Any], forms: list[Form]) -> list[tuple[Any, Form]]:
            args = [*consts, *zip(carry, forms, strict=True), *zip(x, x_forms, strict=True)]
            return self.eval(body.jaxpr, body.consts, args)

        def body_fn(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = run_body(carry, x, carry_forms)
            ys = [_lanes.unheld(v, f) for v, f in outs[n_carry:]]
            y_forms[:] = [f for _, f in ys]
            new_carry = [
                self.convert(v, f, want) if want is not None else v
                for (v, f), want in zip(outs[:n_carry], carry_forms, strict=True)
            ]
            return new_carry, [v for v, _ in ys]

        for _ in range(3 * n_carry + 1):  # Forms move up (`_join`); bounded all the same.
            avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v, _ in init]
            x_avals = [_aval_step(v, f) for v, f in xs]
            found: list[Form] = []
            jax.make_jaxpr(
                lambda c, x, forms=carry_forms, found=found: found.extend(
                    f for _, f in run_body(c, x, forms)[:n_carry]
                )
            )(avals, x_avals)
            joined = [_join(a, b) for a, b in zip(carry_forms, found, strict=True)]
            if joined == carry_forms:
                break
            carry_forms = joined
            init = [
                (self.convert(v, f, want), want) for (v, f), want in zip(init, joined, strict=True)
            ]
        init_values = [v for v, _ in init]
        x_values = [jnp.moveaxis(v, 0, 1) if f == STACKED else v for v, f in xs]
        carry, ys = lax.scan(
            body_fn,
            init_values,
            x_values,
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        outs: list[tuple[Any, Form]] = list(zip(carry, carry_forms, strict=True))
        for y, f in zip(ys, y_forms, strict=True):
            if f == STACKED:
                outs.append((jnp.moveaxis(y, 1, 0), STACKED))
            else:
                outs.append((y, None if f is None else f + 1))
        return outs


def _aval(atom: Any) -> Any:
    """An atom's abstract value (an array's: shape and dtype)."""
    return atom.aval


def _join(a: Form, b: Form) -> Form:
    """A carry's form from its form before a step, `a`, and after it, `b`: unbatched < packed
    < stacked < held (`Lanes`: a later step's, once the first one's shared kernels are per
    client; holding it saves converting it at every step); two held forms: stacked."""
    if a == b or b is None:
        return a
    if a is None:
        return b
    held = [f for f in (a, b) if isinstance(f, Lanes)]
    return held[0] if len(held) == 1 else STACKED


def _aval_step(x: Any, form: Form) -> jax.ShapeDtypeStruct:
    """One scanned step of `x` (its leading axis, after the client axis when stacked)."""
    shape = x.shape[:1] + x.shape[2:] if form == STACKED else x.shape[1:]
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _bind_window(eqn: core.JaxprEqn, values: Sequence[Any]) -> Any:
    """A window operation; on a TPU, one whose windows tile its operand as a reshape and a
    reduction (`_windows`: faster there in the packed round)."""
    tiled = lowering(eqn)
    if tiled is None:
        return rebind(eqn, values)[0]
    return lax.platform_dependent(*values, tpu=tiled, default=lambda *v: rebind(eqn, v)[0])


def _window_leaves(params: dict[str, Any], dim: int) -> bool:
    """Whether a window operation leaves dimension `dim` alone (a window of 1, no padding)."""
    ones = ("window_dimensions", "window_strides", "base_dilation", "window_dilation")
    return all(params[k][dim] == 1 for k in ones if k in params) and tuple(
        params["padding"][dim]
    ) == (0, 0)
