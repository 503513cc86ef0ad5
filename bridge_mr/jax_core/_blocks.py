"""Per-client kernels as one block-diagonal kernel, and a dense product's diagonal blocks back.

The two halves of a packed convolution (`_packed`): G clients' kernels set on the diagonal of
one kernel G times as wide in its input and output features (zeros elsewhere, set, not
multiplied in, so a NaN in one client's kernel stays in its block), and, for a kernel's
gradient computed for every pair of clients at once, each client's own block.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def block_diagonal(kernels: Any, out_dim: int, in_dim: int) -> Any:
    """Stacked kernels [G, ...] as one kernel whose (out, in) block (g, g) is client g's."""
    g = kernels.shape[0]
    shape = kernels.shape[1:]
    x = jnp.moveaxis(kernels, 0, out_dim)  # (.., G, O, ..): client g's rows together.
    at_in = in_dim + 1 if in_dim > out_dim else in_dim
    x = jnp.expand_dims(x, at_in)  # A (broadcast) axis for the input's client, before I.
    at_out = out_dim + 1 if at_in <= out_dim else out_dim
    mask_shape = [1] * x.ndim
    mask_shape[at_out], mask_shape[at_in] = g, g
    eye = jnp.eye(g, dtype=bool)
    mask = (eye if at_out < at_in else eye.T).reshape(mask_shape)
    blocks = jnp.where(mask, x, jnp.zeros((), x.dtype))
    sizes = list(shape)
    sizes[out_dim] *= g
    sizes[in_dim] *= g
    return blocks.reshape(sizes)


def diagonal_blocks(full: Any, a: int, b: int, g: int) -> Any:
    """Blocks (g, g) of `full` (dimensions `a` and `b` each G blocks long), stacked [G, ...]."""
    split = full.reshape(
        [n for i, n in enumerate(full.shape) for n in ((g, n // g) if i in (a, b) else (n,))]
    )
    at_a = a + (b < a)
    at_b = b + (a < b)
    eye = jnp.eye(g, dtype=bool)
    mask_shape = [1] * split.ndim
    mask_shape[at_a], mask_shape[at_b] = g, g
    mask = (eye if at_a < at_b else eye.T).reshape(mask_shape)
    kept = jnp.where(mask, split, jnp.zeros((), split.dtype)).sum(axis=at_b)
    return jnp.moveaxis(kept, at_a if at_a < at_b else at_a - 1, 0)
