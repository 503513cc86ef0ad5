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

#: The 32-bit dtype JAX holds each 64-bit integer dtype as while its 64-bit mode is off.
_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32)}


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

    While JAX's 64-bit mode is off, int64 / uint64 fields become int32 / uint32 (their values
    checked to fit); float64 ones are refused (JAX would narrow them silently).

    Raises:
      TypeError: a float64 / complex128 field with x64 off.
      ValueError: an int64 / uint64 field holds a value outside int32 / uint32.
    """
    moved = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            value = _numpy(owner, name, value)
        if not jax.config.read("jax_enable_x64") and isinstance(value, np.ndarray):
            if value.dtype in (np.float64, np.complex128):
                raise TypeError(
                    f"{owner}: field {name!r} is {value.dtype}, which JAX holds only with "
                    "64-bit mode on (jax.config.update('jax_enable_x64', True)). Fix: convert it "
                    "first (x.float()), or enable x64."
                )
            narrow = _NARROW.get(value.dtype)
            if narrow is not None:
                bounds = np.iinfo(narrow)
                if value.size and (value.min() < bounds.min or value.max() > bounds.max):
                    raise ValueError(
                        f"{owner}: field {name!r} is {value.dtype} and holds values outside "
                        f"{narrow} ([{value.min()}, {value.max()}]), which JAX holds as {narrow} "
                        f"while 64-bit mode is off. Fix: enable x64, or map the values into "
                        f"{narrow}."
                    )
                value = value.astype(narrow)
        moved[name] = jax.device_put(value, device)
    return moved


def _numpy(owner: str, name: str, tensor: torch.Tensor) -> np.ndarray:
    """`tensor`'s values on the host as numpy (bfloat16 as JAX's numpy bfloat16)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; JAX's (ml_dtypes') has.
        return tensor.contiguous().view(torch.int16).numpy().view(jnp.bfloat16)
    try:
        return tensor.numpy()
    except TypeError as err:
        raise TypeError(
            f"{owner}: field {name!r} is {tensor.dtype}, which has no numpy or JAX dtype to go "
            f"to the device as ({err}). Fix: convert it first (x.float())."
        ) from None


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
