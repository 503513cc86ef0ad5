"""A dataset's examples as JAX arrays on an accelerator: each round's gather runs there.

With a CPU build of torch (a TPU host), no torch tensor can live on the chip. The examples go
there once as JAX arrays (`FederatedDataset.to(jax_device)`); a round sends only its example
index and mask and gathers on the chip, and `map_reduce` takes the gathered JAX arrays as
inputs already where its program runs (no transfer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr import dlpack

#: How `bridge_mr.dlpack.to_jax`'s messages name a tensor given alone.
_ROOT = "tree"


def is_array(value: Any) -> bool:
    """Whether `value` is a concrete JAX array."""
    return isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def check_one_place(owner: str, fields: Mapping[str, Any]) -> None:
    """Raises unless `fields` are all torch tensors, or all JAX arrays on one device."""
    places = {frozenset(v.devices()) if is_array(v) else None for v in fields.values()}
    if len(places) > 1:
        kinds = {
            name: f"jax.Array on {', '.join(map(str, v.devices()))}" if is_array(v)
            else type(v).__name__
            for name, v in fields.items()
        }  # fmt: skip
        raise TypeError(
            f"{owner}: expected every field to be a torch tensor, or every field a JAX array on "
            f"one device, got {kinds}. Fix: build the dataset from tensors, then "
            "FederatedDataset.to(jax_device) puts every field on that device."
        )


def to_device(owner: str, fields: Mapping[str, Any], device: Any) -> dict[str, jax.Array]:
    """`fields` (torch tensors or JAX arrays) as JAX arrays on `device`, each copied there once.

    Tensors cross as `bridge_mr.dlpack.to_jax` takes them, with its dtype rules: while JAX's
    64-bit mode is off, int64 / uint64 fields become int32 / uint32 (their values checked to
    fit) and float64 / complex128 ones are refused (JAX would narrow them silently).

    Raises:
      TypeError: a field JAX cannot hold (float64 / complex128 with x64 off, a dtype without
        a JAX dtype), naming the field and the fix.
      ValueError: an int64 / uint64 field holds a value outside int32 / uint32.
    """
    moved = {}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            moved[name] = jax.device_put(value, device)
            continue
        try:
            # Row-major first: shared in its own layout, a permuted tensor (NHWC stored, NCHW
            # seen) became an array whose device_put copy jaxlib 0.10.2 computed on wrongly.
            shared = dlpack.to_jax(value.detach().cpu().contiguous())
        except (TypeError, ValueError) as error:
            # to_jax names a lone tensor "tree"; here it is the dataset's field.
            detail = str(error).removeprefix(_ROOT)
            raise type(error)(f"{owner}: field {name!r}{detail}") from None
        # to_jax shares the tensor's memory: a copy, so that the tensor's later in-place
        # changes stay out of the dataset (on a CPU device, device_put alone would alias).
        moved[name] = jax.device_put(shared, device, may_alias=False)
    # The copies run asynchronously and read the tensors' memory while they run: an in-place
    # change right after `to` returned reached about one in five 8 MB copies before this wait.
    return jax.block_until_ready(moved)


def gather(
    examples: Mapping[str, jax.Array], index: torch.Tensor, mask: torch.Tensor,
    shape: tuple[int, ...],
) -> dict[str, jax.Array]:  # fmt: skip
    """Each field's rows at `index` (`[rows * slots]`, host) and the `mask` (`[rows, slots]`),
    shaped `shape + field[1:]`, gathered on the examples' device: only the index and the mask
    cross."""
    first = next(iter(examples.values()))
    (device,) = first.devices()
    on_device = jax.device_put(index.numpy().astype(np.int32), device)
    batches = {
        name: jnp.take(value, on_device, axis=0).reshape(*shape, *value.shape[1:])
        for name, value in examples.items()
    }
    batches["mask"] = jax.device_put(mask.numpy().reshape(shape), device)
    return batches
