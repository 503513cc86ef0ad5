"""XLA:CPU options chosen per program, and float sums as accurate as torch's where they need it.

XLA:CPU (jaxlib 0.10) hands some fusions to YNNPACK; which ones is the compiler option
`xla_cpu_experimental_ynn_fusion_type`, settable per compilation. No one setting is fastest for
every program (benchmarks/results/NOTES.md, 2026-12-04), so `cpu_compiler_options` chooses from
what the program contains:

* a convolution: no YNNPACK fusion (they slowed a CNN client's round 1.7x and vmapped grouped
  convolutions 11x);
* a wide float sum inside a loop body (a result of `WIDE` or more elements, each the sum of no
  more values than the result has: arrays added elementwise, like a chunk's client deltas, or
  each client's batch under `vmap` of a scan of training steps): no reduce fusion
  (jax-ml/jax#37465: 0.62-0.79x the time of jaxlib's default on FedAvg rounds of a dense model,
  0.006x on a chunked FedAvg round of 1M parameters);
* anything else: jaxlib's default (its reduce fusion makes a transformer round 1.7-2.6x faster).

Without YNNPACK's reduce fusion XLA:CPU sums a reduction in one sequential accumulator: over
the 7,200 values a BatchNorm sums per channel of a [8, 8, 30, 30] batch, float32 means come out
~20x less accurate than with it (2.4e-6 against 1.2e-7 relative). `accurate_sums` rewrites each
large float sum into a cascade of sums of at most about `BLOCK` values each, with an optimization
barrier after each level so that XLA cannot merge them back (1.2e-7 on that batch, as accurate
as jaxlib's reduce fusion and torch). `cpu_program` applies it, after differentiation when it
wraps the whole program, exactly where the options turn the reduce fusion off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend.core.primitives import conv_general_dilated_p, reduce_sum_p

from ._layouts import canonical_convolution, sharded
from ._rewrite import Rule, equations, rewritten

F = TypeVar("F", bound=Callable[..., Any])

#: The per-compile option: which XLA:CPU fusions go to YNNPACK (enum names only, no `-reduce`).
#: jaxlib 0.10.2 (the oldest bridge_mr supports); a jaxlib that drops the option rejects it at
#: compile time, which tests/jax_core/test_cpu.py pins.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
#: No YNNPACK fusion at all.
NO_YNN_FUSIONS = ""
#: jaxlib 0.10.2's default without its reduce fusion: the same compiled programs as the process
#: flag `--xla_cpu_experimental_ynn_fusion_type=-reduce` (its default is REDUCE,INDIVIDUAL_DOT).
NO_REDUCE_FUSION = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"

#: Sums over fewer values stay as they are: a sequential float32 sum of n values errs by about
#: n / 2 units in the last place at worst, and more kernels cost more than that is worth.
MIN_BLOCKED = 512
#: The most values one level of a rewritten sum adds up, about: 7,200 values sum in 3 levels of
#: ~19, the error of a sequential sum of ~57 values instead of 7,200.
BLOCK = 32

#: The fewest results of a sum in a loop body that make it "wide" (see the module). The wide sums
#: measured: FedAvg rounds of dense models 8,192 and up; none in a transformer LM's local steps
#: (2,048 at most) or a FedSGD round's (1,024), which run fastest with jaxlib's default.
WIDE = 4096

_LOOPS = frozenset({"scan", "while"})


def cpu_compiler_options(jaxpr: core.ClosedJaxpr | core.Jaxpr) -> dict[str, str]:
    """The XLA compiler options bridge_mr compiles `jaxpr` with for CPU (see the module).

    No YNNPACK fusion where `jaxpr` (or any sub-jaxpr) has a convolution; no YNNPACK reduce
    fusion where a loop body has a wide float sum (see the module); else none to set (jaxlib's
    default). bridge_mr's torch functions compile their CPU programs so; pass them yourself
    where you jit a JAX program (a CNN's FedAvg round through `map_reduce`, say), with
    `cpu_program` around it for sums as accurate as torch's.

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
      >>> cpu_compiler_options(jax.make_jaxpr(jnp.sin)(1.0))  # nothing to set
      {}
    """
    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    if has_convolution(open_jaxpr):
        return {YNN_OPTION: NO_YNN_FUSIONS}
    if _has_wide_sum_in_loop(open_jaxpr, in_loop=False):
        return {YNN_OPTION: NO_REDUCE_FUSION}
    return {}


def accurate_sums(fn: F) -> F:
    """`fn` with every large float sum computed in two levels (see the module).

    Each call traces `fn`, rewrites every `reduce_sum` of a float32 (or narrower) array over
    `MIN_BLOCKED` or more values (in every sub-jaxpr: scan and while bodies, conditionals,
    nested jits) into levels of sums of at most about `BLOCK` values each, an optimization
    barrier after each, then evaluates it. Wrap the whole program you jit, gradients included,
    so that the backward pass's sums are rewritten too. The rewritten program computes the same
    sums, differently rounded: XLA:CPU without YNNPACK's reduce fusion sums in one sequential
    accumulator, whose error grows with the count.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).

    Returns:
      A function with `fn`'s signature and results.

    Example:
      >>> from bridge_mr.jax_core import accurate_sums
      >>> x = jnp.linspace(0.0, 1.0, 8 * 8 * 30 * 30).reshape(8, 8, 30, 30)
      >>> mean = lambda x: x.mean(axis=(0, 2, 3))
      >>> bool(jnp.allclose(jax.jit(accurate_sums(mean))(x), mean(x)))
      True
      >>> "optimization_barrier" in str(jax.make_jaxpr(accurate_sums(mean))(x))
      True
    """
    return rewritten(fn, lambda closed: (blocked_sum,))


def cpu_program(fn: F) -> F:
    """`fn` as bridge_mr compiles it for CPU.

    Its convolutions in XLA:CPU's canonical layout (`canonical_layouts`), and its large float
    sums in levels (`accurate_sums`) where the program's options (`cpu_compiler_options`) leave
    XLA without YNNPACK's reduce fusion. One trace per call, both rewrites on it. Wrap the whole
    program, gradients included.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).

    Returns:
      A function with `fn`'s signature and results.

    Example:
      >>> from bridge_mr.jax_core import cpu_compiler_options, cpu_program
      >>> def loss(w, x):  # NCHW convolution, then batch statistics over (N, H, W)
      ...     h = jax.lax.conv(x, w, window_strides=(1, 1), padding="SAME")
      ...     return (h - h.mean(axis=(0, 2, 3), keepdims=True)).var()
      >>> w, x = jnp.ones((4, 3, 3, 3)), jnp.ones((8, 3, 16, 16))
      >>> program = cpu_program(jax.value_and_grad(loss))
      >>> options = cpu_compiler_options(jax.make_jaxpr(program)(w, x))
      >>> value, grad = jax.jit(program, compiler_options=options)(w, x)
    """

    def rules(closed: core.ClosedJaxpr) -> Sequence[Rule]:
        if cpu_compiler_options(closed):
            return (canonical_convolution, blocked_sum)
        return (canonical_convolution,)

    return rewritten(fn, rules)


def blocked_sum(eqn: core.JaxprEqn) -> list[core.JaxprEqn] | None:
    """A large float `reduce_sum` as a cascade of small sums (a `_rewrite` rule)."""
    if eqn.primitive is not reduce_sum_p or eqn.params.get("out_sharding") is not None:
        return None
    aval: Any = eqn.invars[0].aval
    axes = tuple(sorted(eqn.params["axes"]))
    if not jnp.issubdtype(aval.dtype, jnp.floating) or aval.dtype == np.float64:
        return None
    if sharded(aval):
        return None  # A split of a sharded axis would need its sharding in the type.
    shape = tuple(aval.shape)
    if math.prod(shape[a] for a in axes) < MIN_BLOCKED:
        return None
    return equations(lambda x: _sum_in_levels(x, axes), eqn)


def _sum_in_levels(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """`x` summed over `axes` as a cascade of sums of at most about `BLOCK` values each, with an
    optimization barrier after each but the last."""
    count = math.prod(x.shape[a] for a in axes)
    levels = math.ceil(math.log(count) / math.log(BLOCK)) if count > BLOCK else 1
    if levels == 1:
        return jnp.sum(x, axis=axes)
    split = _split(tuple(x.shape), axes, count, round(count ** (1 / levels)))
    if split is None:
        return jnp.sum(x, axis=axes)
    new_shape, inner, outer = split
    partial = lax.optimization_barrier(jnp.sum(x.reshape(new_shape), axis=inner))
    return _sum_in_levels(partial, outer)


def _split(
    shape: tuple[int, ...], axes: tuple[int, ...], count: int, target: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(the operand's shape with at most one reduced axis split in two, the inner axes, the
    outer ones numbered after the inner sum): an inner sum over about `target` values, or None
    where none is possible but all of them or one (a prime-sized single axis, say)."""
    inner_size, cut = 1, len(axes)
    while cut > 0 and inner_size * shape[axes[cut - 1]] <= target:
        cut -= 1
        inner_size *= shape[axes[cut]]
    factor = 1
    if cut > 0:  # Split the next axis so that the inner sum comes near the target.
        size = shape[axes[cut - 1]]
        divisors = [d for d in range(2, size) if size % d == 0]
        if divisors:
            factor = min(divisors, key=lambda d: abs(math.log(inner_size * d / target)))
    if inner_size * factor == 1 or inner_size * factor == count:
        return None
    new_shape: list[int] = []
    inner_axes: list[int] = []
    outer_axes: list[int] = []
    for a, size in enumerate(shape):
        if factor > 1 and cut > 0 and a == axes[cut - 1]:
            outer_axes.append(len(new_shape))
            new_shape.append(size // factor)
            inner_axes.append(len(new_shape))
            new_shape.append(factor)
        else:
            if a in axes:
                (inner_axes if a in axes[cut:] else outer_axes).append(len(new_shape))
            new_shape.append(size)
    after = [o - sum(i < o for i in inner_axes) for o in outer_axes]
    return tuple(new_shape), tuple(inner_axes), tuple(after)


def has_convolution(jaxpr: core.Jaxpr) -> bool:
    """Whether `jaxpr` (or any jaxpr inside it) has a convolution."""
    return any(
        eqn.primitive is conv_general_dilated_p
        or any(map(has_convolution, core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def _has_wide_sum_in_loop(jaxpr: core.Jaxpr, *, in_loop: bool) -> bool:
    for eqn in jaxpr.eqns:
        if in_loop and eqn.primitive is reduce_sum_p and _wide(eqn):
            return True
        loop = in_loop or eqn.primitive.name in _LOOPS
        if any(_has_wide_sum_in_loop(j, in_loop=loop) for j in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _wide(eqn: core.JaxprEqn) -> bool:
    """Whether a sum is a wide float one: `WIDE` or more results, each of at most that many."""
    aval: Any = eqn.invars[0].aval
    if not jnp.issubdtype(aval.dtype, jnp.floating):
        return False
    axes = set(eqn.params["axes"])
    count = math.prod(s for a, s in enumerate(aval.shape) if a in axes)
    results = math.prod(s for a, s in enumerate(aval.shape) if a not in axes)
    return results >= WIDE and count <= results
