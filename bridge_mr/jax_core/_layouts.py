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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend.core.primitives import conv_general_dilated_p

from ._rewrite import equations, rewritten

F = TypeVar("F", bound=Callable[..., Any])

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "bridge_mr_program_platform", default=None
)


@contextlib.contextmanager
def programs_for(platform: str) -> Iterator[None]:
    """Programs traced inside are for `platform` ("tpu", say), not JAX's default backend.

    For programs JAX only traces and exports, to run elsewhere: beside TorchTPU, JAX is kept
    to the CPU, and `map_reduce` would otherwise lay out its convolutions for XLA:CPU. JAX's
    trace caches do not see this setting: a function of yours that `jax.jit` traced outside
    it is not traced again inside it (bridge_mr's own programs are new functions per trace).
    Only the layouts differ, never the values.

    Args:
      platform: the platform the programs will run on, as `jax.default_backend()` names it
        ("cpu", "gpu", "tpu").

    Yields:
      Nothing; inside, `program_platform()` is `platform`.

    Example:
      >>> from bridge_mr.jax_core import program_platform, programs_for
      >>> with programs_for("tpu"):
      ...     program_platform()
      'tpu'
    """
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def program_platform() -> str:
    """The platform the programs traced now are for: `programs_for`'s, else JAX's default.

    Returns:
      A platform name ("cpu", "gpu", "tpu").

    Example:
      >>> bridge_mr.jax_core.program_platform() == jax.default_backend()
      True
    """
    return _PLATFORM.get() or jax.default_backend()


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

    return rewritten(fn, lambda closed: (canonical_convolution,))


def canonical_convolution(eqn: core.JaxprEqn) -> list[core.JaxprEqn] | None:
    """A convolution `eqn` as transposes around a canonical convolution (a `_rewrite` rule):
    None for another equation, or a convolution that is canonical or explicitly sharded."""
    if eqn.primitive is not conv_general_dilated_p:
        return None
    dims: lax.ConvDimensionNumbers = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dims.lhs_spec, dims.rhs_spec, dims.out_spec
    n = len(lhs_spec) - 2
    to_lhs = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])  # (batch, spatial..., feature)
    to_rhs = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])  # (spatial..., in, out)
    from_out = tuple(int(i) for i in np.argsort((out_spec[0], *out_spec[2:], out_spec[1])))
    identity = tuple(range(n + 2))
    avals: list[Any] = [atom.aval for atom in eqn.invars]
    if to_lhs == to_rhs == from_out == identity:
        return None
    if eqn.params.get("out_sharding") is not None or any(map(sharded, avals)):
        return None  # The shardings in the types would need the same permutations.
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, n + 1, *range(1, n + 1)),
        rhs_spec=(n + 1, n, *range(n)),
        out_spec=(0, n + 1, *range(1, n + 1)),
    )
    params = {**eqn.params, "dimension_numbers": canonical}

    def convolution(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = conv_general_dilated_p.bind(_moved(lhs, to_lhs), _moved(rhs, to_rhs), **params)
        return _moved(out, from_out)

    return equations(convolution, eqn)


def sharded(aval: Any) -> bool:
    """Whether `aval` is sharded explicitly (an Explicit mesh axis in its type)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    return any(axis is not None for axis in spec)


def _moved(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    return x if tuple(perm) == tuple(range(len(perm))) else lax.transpose(x, tuple(perm))
