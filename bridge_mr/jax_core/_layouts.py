"""Convolutions in the one layout XLA:CPU runs fast, inside loops as well as outside.

XLA:CPU runs a convolution through Eigen only in its canonical layout: input (batch, spatial...,
feature), kernel (spatial..., in, out), output (batch, spatial..., feature). The XLA pass that
rewrites other convolutions into that form (`ConvCanonicalization`) visits the entry computation
only, so a convolution in a loop body (a `lax.scan` over clients or over local steps) keeps the
layout it was written in (PyTorch's NCHW/OIHW, say) and runs on a generic, much slower path; so
does every convolution of its gradient, which comes in the layouts the transpose rules choose.
`canonical_layouts` does the same rewrite on the jaxpr, in every sub-jaxpr: each convolution
becomes transposes around a canonical convolution. The values are the same convolution's (the
transposes only move data), gradients are taken of the rewritten program as usual, and outside
loops XLA finds the transposes it would have inserted itself.

`cpu_compiler_options` gives the XLA compiler options a CPU program with convolutions compiles
best with: YNNPACK's fusions (on by default in jaxlib 0.10) slow the convolutions' neighbours and
gradients down (see benchmarks/results/NOTES.md), so programs with convolutions compile without
them; programs without keep the process's setting (`recommended_xla_flags`), which suits dense
layers best.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend.core.primitives import conv_general_dilated_p

F = TypeVar("F", bound=Callable[..., Any])

#: The per-compile override of `--xla_cpu_experimental_ynn_fusion_type`: no YNNPACK fusion type.
#: jaxlib 0.10.2 (the oldest bridge_mr supports); a jaxlib that drops the option rejects it at
#: compile time, which tests/jax_core/test_layouts.py pins.
_NO_YNN_FUSIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}


def canonical_layouts(fn: F) -> F:
    """`fn` with every convolution it runs in XLA:CPU's canonical layout (see the module).

    `map_reduce` applies it to the client function on CPU; apply it yourself to a function
    that runs convolutions inside its own loops (a `lax.scan` of training steps, say). Each
    call traces `fn` (under whatever transformation the call is under), rewrites the jaxpr and
    evaluates it: the same values, outputs and pytrees as `fn`, differentiable and batchable
    as usual. Sub-jaxprs (scans, while loops, conditionals, nested jits, checkpoints, custom
    derivatives' primal functions) are rewritten too. Convolutions on explicitly sharded
    values (an Explicit mesh axis in their type) are left as they are.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).

    Returns:
      A function with `fn`'s signature and results.

    Raises:
      Whatever tracing `fn` raises.

    Example:
      >>> from bridge_mr.jax_core import canonical_layouts
      >>> def convolve(w, xs):  # NCHW / OIHW convolutions, inside a rolled scan
      ...     conv = lambda x: jax.lax.conv(x, w, window_strides=(1, 1), padding="SAME")
      ...     return jax.lax.scan(lambda carry, x: (carry, conv(x)), None, xs)[1]
      >>> w, xs = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 1, 3, 8, 8))  # 2 steps of [1, 3, 8, 8]
      >>> fast = jax.jit(canonical_layouts(convolve))
      >>> bool(jnp.allclose(fast(w, xs), jax.jit(convolve)(w, xs)))  # the same values
      True
      >>> "transpose" in str(jax.make_jaxpr(canonical_layouts(convolve))(w, xs))
      True
    """

    @functools.wraps(fn)
    def rewritten(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = core.jaxpr_as_fun(_closed(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return rewritten  # type: ignore[return-value]


def cpu_compiler_options(jaxpr: core.ClosedJaxpr | core.Jaxpr) -> dict[str, str]:
    """The XLA compiler options bridge_mr compiles `jaxpr` with for CPU (see the module).

    `{"xla_cpu_experimental_ynn_fusion_type": ""}` (no YNNPACK fusion) when `jaxpr` (or any
    sub-jaxpr) has a convolution, else none. bridge_mr's torch functions compile their CPU
    programs so; pass them yourself where you jit a JAX program with convolutions (a CNN's
    FedAvg round through `map_reduce`, say).

    Args:
      jaxpr: the program, as `jax.make_jaxpr(f)(*args)` or `jax.jit(f).trace(*args).jaxpr`
        gives it.

    Returns:
      Options for `jax.jit(..., compiler_options=...)` or `.lower(...).compile(...)`; a new
      dict (empty: nothing to override).

    Example:
      >>> from bridge_mr.jax_core import cpu_compiler_options
      >>> conv = lambda x, w: jax.lax.conv(x, w, window_strides=(1, 1), padding="SAME")
      >>> traced = jax.jit(conv).trace(jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3)))
      >>> options = cpu_compiler_options(traced.jaxpr)
      >>> options
      {'xla_cpu_experimental_ynn_fusion_type': ''}
      >>> compiled = traced.lower().compile(options)
      >>> cpu_compiler_options(jax.make_jaxpr(jnp.sin)(1.0))  # no convolution: nothing to set
      {}
    """
    found = _has_convolution(jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr)
    return dict(_NO_YNN_FUSIONS) if found else {}


def _has_convolution(jaxpr: core.Jaxpr) -> bool:
    return any(
        eqn.primitive is conv_general_dilated_p
        or any(map(_has_convolution, core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def _closed(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    jaxpr = _open(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else core.ClosedJaxpr(jaxpr, closed.consts)


def _open(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """`jaxpr` with its convolutions rewritten, or `jaxpr` itself when nothing changed."""
    eqns: list[core.JaxprEqn] = []
    changed = False
    for eqn in jaxpr.eqns:
        if eqn.primitive is conv_general_dilated_p:
            replacement = _canonical_convolution(eqn)
        else:
            params = {name: _param(value) for name, value in eqn.params.items()}
            same = all(params[name] is value for name, value in eqn.params.items())
            replacement = [eqn] if same else [eqn.replace(params=params)]
        changed = changed or replacement != [eqn]
        eqns += replacement
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _param(value: Any) -> Any:
    if isinstance(value, core.ClosedJaxpr):
        return _closed(value)
    if isinstance(value, core.Jaxpr):
        return _open(value)
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, core.ClosedJaxpr | core.Jaxpr) for v in value)
    ):
        rewritten = tuple(_param(v) for v in value)
        return value if all(a is b for a, b in zip(rewritten, value, strict=True)) else rewritten
    return value


def _canonical_convolution(eqn: core.JaxprEqn) -> list[core.JaxprEqn]:
    """The equations of `eqn` (a convolution) as transposes around a canonical convolution."""
    dims: lax.ConvDimensionNumbers = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dims.lhs_spec, dims.rhs_spec, dims.out_spec
    n = len(lhs_spec) - 2
    to_lhs = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])  # (batch, spatial..., feature)
    to_rhs = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])  # (spatial..., in, out)
    from_out = tuple(int(i) for i in np.argsort((out_spec[0], *out_spec[2:], out_spec[1])))
    identity = tuple(range(n + 2))
    avals: list[Any] = [atom.aval for atom in eqn.invars]
    if to_lhs == to_rhs == from_out == identity:
        return [eqn]
    if eqn.params.get("out_sharding") is not None or any(map(_sharded, avals)):
        return [eqn]  # The shardings in the types would need the same permutations.
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, n + 1, *range(1, n + 1)),
        rhs_spec=(n + 1, n, *range(n)),
        out_spec=(0, n + 1, *range(1, n + 1)),
    )
    params = {**eqn.params, "dimension_numbers": canonical}

    def convolution(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = conv_general_dilated_p.bind(_moved(lhs, to_lhs), _moved(rhs, to_rhs), **params)
        return _moved(out, from_out)

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    small = jax.make_jaxpr(convolution)(*specs)
    assert not small.consts  # Transposes and a convolution of the two inputs only.
    return _inlined(small.jaxpr, eqn.invars, eqn.outvars, eqn)


def _sharded(aval: Any) -> bool:
    """Whether `aval` is sharded explicitly (an Explicit mesh axis in its type)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    return any(axis is not None for axis in spec)


def _moved(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    return x if tuple(perm) == tuple(range(len(perm))) else lax.transpose(x, tuple(perm))


def _inlined(
    small: core.Jaxpr, invars: Sequence[Any], outvars: Sequence[Any], original: core.JaxprEqn
) -> list[core.JaxprEqn]:
    """`small`'s equations reading `invars` and writing `outvars`, with `original`'s source."""
    rename: dict[Any, Any] = dict(zip(small.invars, invars, strict=True))
    rename.update(zip(small.outvars, outvars, strict=True))
    return [
        eqn.replace(
            invars=[rename.get(v, v) if isinstance(v, core.Var) else v for v in eqn.invars],
            outvars=[rename.get(v, v) for v in eqn.outvars],
            source_info=original.source_info,
            ctx=original.ctx,
        )
        for eqn in small.eqns
    ]
