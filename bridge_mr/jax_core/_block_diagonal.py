"""Grouped convolutions as dense ones with block-diagonal kernels: an exact, opt-in lowering.

`jax.vmap` of a convolution whose input and kernel both vary per client becomes one grouped
convolution, a group per client (`feature_group_count`; a gradient taken outside the vmap gives
`batch_group_count`). `block_diagonal_convolutions` rewrites each such convolution of at most
`max_groups` groups into one ungrouped convolution: the groups' inputs side by side in the
features (group g's feature c at g x C + c) and their kernels as the diagonal blocks of one
kernel, zeros elsewhere. It does G times the grouped convolution's arithmetic (the zero blocks)
in one convolution whose features are G times wider: a matrix unit of 128 lanes runs a client's
32 or 64 channels a quarter or half full, and the G clients' products side by side fill it.
Issue 42 asks whether a few clients at a time so beat one at a time on a TPU (where XLA's own
grouped convolutions measured 1.8-3.5x slower than one client at a time); that is measured with
`benchmarks/studies/bench_conv_lowering.py` and `bench_cnn_forms.py` ("packG"), not yet on the
chip. Nothing applies it by default.

Values: the zero blocks add exact zeros, so each group's outputs are its own up to the order of
the float sums while every value is finite. A non-finite value (inf or NaN) of one group, in its
input or, under a gradient, in the cotangent flowing back through its kernel, meets the zero
blocks (0 x inf is NaN) and makes the other groups' values NaN too, where XLA:CPU's grouped
convolution keeps it in its group: one diverging client then spoils its chunk's other clients,
which matters to whatever looks at each client's result (dropping or clipping bad clients).

A convolution stays as it is where it is ungrouped, has more than `max_groups` groups (counted
with the client's own: a depthwise convolution's channels times the clients; the rewrite's
arithmetic and kernel grow with the groups' square), or takes explicitly sharded values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from ._grouped import convolution_rule
from ._rewrite import Rule, rewritten

F = TypeVar("F", bound=Callable[..., Any])

#: `block_diagonal_convolutions`' default: convolutions of more groups stay grouped.
MAX_GROUPS = 16


def block_diagonal_convolutions(fn: F, max_groups: int = MAX_GROUPS) -> F:
    """`fn` with its grouped convolutions as dense ones of block-diagonal kernels (the module).

    Convolutions of at most `max_groups` groups are rewritten. Opt-in and not measured faster
    anywhere yet: apply it to a JAX function that vmaps convolutions over a few clients' own
    weights (`map_reduce(strategy="chunks", chunk_size=G)` of local training, say) and time it
    against the function as it is on your device. Each call traces `fn` (under whatever
    transformation the call is under), rewrites the jaxpr (sub-jaxprs too: scans, loops,
    conditionals, checkpoints) and evaluates it: the same outputs and pytrees as `fn`,
    differentiable and batchable as usual. It sees the groups of the vmaps inside `fn`: wrap
    the vmapped function (`block_diagonal_convolutions(jax.vmap(client))`), not the client.

    Args:
      fn: a JAX function of positional arguments (pytrees of arrays).
      max_groups: the most groups a convolution may have to be rewritten (at least 2).

    Returns:
      A function with `fn`'s signature and results.

    Raises:
      ValueError: `max_groups` is not an int of at least 2.

    Example:
      >>> from bridge_mr.jax_core import block_diagonal_convolutions
      >>> def per_client(w, x):  # one client's NCHW convolution of its own kernel
      ...     return jax.lax.conv(x, w, window_strides=(1, 1), padding="SAME")
      >>> ws, xs = jnp.ones((4, 64, 32, 3, 3)), jnp.ones((4, 10, 32, 28, 28))  # 4 clients
      >>> grouped = jax.vmap(per_client)  # one convolution of 4 groups
      >>> dense = block_diagonal_convolutions(grouped)  # one of 4 x 32 in, 4 x 64 out
      >>> bool(jnp.allclose(jax.jit(dense)(ws, xs), jax.jit(grouped)(ws, xs)))
      True
      >>> "feature_group_count=1" in str(jax.make_jaxpr(dense)(ws, xs))
      True
    """
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 2:
        raise ValueError(
            f"block_diagonal_convolutions: expected max_groups to be an int of at least 2 (the "
            f"most groups a rewritten convolution may have), got {max_groups!r}. Fix: pass the "
            f"largest chunk of clients you vmap at once, e.g. max_groups=8."
        )
    rule = grouped_as_block_diagonal(max_groups)
    return rewritten(fn, lambda closed: (rule,))


def grouped_as_block_diagonal(max_groups: int) -> Rule:
    """The `_rewrite` rule: a convolution of 2 to `max_groups` groups as a dense one, None for
    any other equation."""

    def in_range(eqn: core.JaxprEqn) -> bool:
        groups = eqn.params["feature_group_count"] * eqn.params["batch_group_count"]
        return 2 <= groups <= max_groups

    return convolution_rule(block_diagonal_convolution, in_range)


def block_diagonal_convolution(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    dimension_numbers: lax.ConvDimensionNumbers,
    feature_group_count: int,
    batch_group_count: int,
    precision: Any,
    preferred_element_type: Any,
    **_: Any,
) -> jax.Array:
    """`lax.conv_general_dilated` with these params, computed as one ungrouped convolution."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    x = lax.transpose(lhs, tuple(lhs_spec))  # (N, C, spatial...)
    w = lax.transpose(rhs, tuple(rhs_spec))  # (O, C / feature groups, window...)
    if batch_group_count > 1:  # The batch's groups (group-major) side by side in the features.
        g = batch_group_count
        n, c, *spatial = x.shape
        x = jnp.swapaxes(x.reshape(g, n // g, c, *spatial), 0, 1).reshape(n // g, g * c, *spatial)
    else:
        g = feature_group_count
    o, per_group, *window = w.shape
    blocks = w.reshape(g, o // g, per_group, *window)
    # Group i's block at rows i x O', columns i x C' (padded in: no product with the zeros).
    config = [(0, 0, 0)] * (w.ndim + 1)
    kernel = jnp.concatenate(
        [
            lax.pad(
                blocks[i],
                lax.full((), 0, w.dtype),
                [config[0], (i * per_group, (g - 1 - i) * per_group, 0), *config[2:-1]],
            )
            for i in range(g)
        ]
    )  # (O, G x C', window...)
    in_order = tuple(range(x.ndim))  # (N, C, spatial...), (O, I, window...), (N, O, spatial...)
    out = lax.conv_general_dilated(
        x,
        kernel,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        lax.ConvDimensionNumbers(in_order, in_order, in_order),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return lax.transpose(out, tuple(int(i) for i in np.argsort(out_spec)))
