"""A packed convolution of images as a product of patches: a TPU's lowering at "highest".

On a TPU v5e at "highest" (each float32 product in six bfloat16 passes), the packed CNN round's
first convolution, whose input is G clients' images packed into G x 3 channels, and its
kernel's gradient (the images against the output gradients) ran far below the matrix unit's
rate. As strided slices of the input (its patches) and one matrix product
(`_grouped.grouped_convolution`), the pfl CNN FedAvg round of bridge_mr's packed strategy, data
on the chip, took 636.7 ms at 500 clients against 725.1 ms with the convolutions, and 64.8
against 73.8 ms at 50 (side by side: benchmarks/results/tpu_v5e/bench_image_patches.txt). At
"medium" (one bfloat16 pass) the same change to a hand-written packed round was slower (135
against 124 ms at 500 clients), and patches for the second convolution too (32 channels a
client) gained 3% more at "highest" but lost 48% at "medium", so the rule is narrow: a dense
convolution (no feature or batch groups, no output sharding) of float32 operands whose input
has at most `settings.PACKED_PATCH_FEATURES` features a client, whose patches are at most
`MAX_SLICES` slices and not empty, at "highest" (the convolution's `precision`, which JAX sets
from `jax.default_matmul_precision` as it traces; an algorithm preset is not read as
"highest"). The patch form is traced on every platform but runs on a TPU only
(`lax.platform_dependent`). The slices are exact; the product adds the convolution's terms in
another order.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend import core

from . import settings
from ._grouped import grouped_convolution, patch_slices
from ._rewrite import rebind

#: The most strided slices a convolution's patches are made of (the fewer of its window offsets
#: and output positions): the measured kernels were 3 x 3; a larger window copies the input
#: more times (a 7 x 7 kernel: 49) and is not measured.
MAX_SLICES = 9


def convolution(eqn: core.JaxprEqn, lhs: Any, rhs: Any, dim: int, size: int, **changed: Any) -> Any:
    """`eqn`'s convolution of `lhs` (`size` clients packed along its dimension `dim`) and `rhs`,
    its params updated by `changed`: as patches and a product on a TPU where the rule (see the
    module) holds; elsewhere, the convolution."""
    params = {**eqn.params, **changed}
    out: Any = eqn.outvars[0].aval  # a ShapedArray; the packing keeps its spatial sizes
    slices = patch_slices(rhs.shape, out.shape, params["dimension_numbers"])

    def bound(lhs: Any, rhs: Any) -> Any:
        return rebind(eqn, [lhs, rhs], **changed)[0]

    if (
        lhs.shape[dim] // size > settings.PACKED_PATCH_FEATURES
        or params["feature_group_count"] != 1
        or params["batch_group_count"] != 1
        or params.get("out_sharding") is not None
        or not 0 < slices <= MAX_SLICES
        or not at_highest(params["precision"], lhs.dtype, rhs.dtype)
    ):
        return bound(lhs, rhs)
    patches = functools.partial(grouped_convolution, **params)
    return lax.platform_dependent(lhs, rhs, tpu=patches, default=bound)


def at_highest(precision: Any, *dtypes: Any) -> bool:
    """Whether a product of operands of these types at `precision` (an equation's, as JAX
    traced it: None, a pair of `lax.Precision` or an algorithm preset) is float32's at its full
    precision."""
    if any(jnp.dtype(d) != jnp.float32 for d in dtypes):
        return False
    return isinstance(precision, tuple) and all(p == lax.Precision.HIGHEST for p in precision)
