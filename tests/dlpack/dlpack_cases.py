"""Tensors of every supported dtype in every layout the converters distinguish."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import pytest
import torch

DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
#: The dtypes that need JAX's 64-bit mode.
WIDE_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.int64, torch.uint64, torch.complex128)


def dtype_params(dtypes: Sequence[torch.dtype] = DTYPES) -> list[Any]:
    """`dtypes` as pytest parameters, the 64-bit ones marked `x64` (they run in the x64 leg)."""
    return [pytest.param(d, marks=pytest.mark.x64) if d in WIDE_DTYPES else d for d in dtypes]


def dtypes_for_this_mode() -> tuple[torch.dtype, ...]:
    """Every dtype while JAX's 64-bit mode is on; without the 64-bit ones while it is off."""
    if jax.config.jax_enable_x64:
        return DTYPES
    return tuple(d for d in DTYPES if d not in WIDE_DTYPES)


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A fresh contiguous tensor of distinct-looking values of `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_complex:
        real = torch.randn(shape, generator=generator, dtype=torch.float64)
        imag = torch.randn(shape, generator=generator, dtype=torch.float64)
        return torch.complex(real, imag).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(0, 100, shape, generator=generator, dtype=torch.int64).to(dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How to build a tensor, and whether JAX can share its memory."""

    name: str
    make: Callable[[torch.dtype], torch.Tensor]
    compact_and_aligned: bool
    permuted: bool = False

    @property
    def zero_copy(self) -> bool:
        """Whether the import shares memory (permuted-dense layouts too, on jaxlib >= 0.10.2)."""
        return self.compact_and_aligned


LAYOUTS: tuple[Layout, ...] = (
    Layout("contiguous", lambda d: values((3, 4), d), True),
    Layout("transposed", lambda d: values((4, 3), d).t(), True, permuted=True),
    Layout("permuted3d", lambda d: values((2, 3, 4), d).permute(2, 0, 1), True, permuted=True),
    Layout("sliced", lambda d: values((3, 8), d)[:, ::2], False),
    Layout("expanded", lambda d: values((1, 4), d).expand(3, 4), False),
    Layout("offset", lambda d: values((13,), d)[1:].reshape(3, 4), False),
    Layout("zero_d", lambda d: values((), d), True),
    Layout("empty", lambda d: values((0, 3), d), True),
)
