"""Tensors of every supported dtype in every layout the converters distinguish."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
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
WIDE_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.int64, torch.uint64, torch.complex128)

#: Measured: jaxlib 0.10 and 0.11 share permuted-dense (transposed) tensors correctly on CPU and
#: GPU; jaxlib 0.7 accepts them but ignores the permutation, so bridge_mr copies them there.
PERMUTED_ZERO_COPY = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 10)


def x64_disabled() -> contextlib.AbstractContextManager[Any]:
    """A context in which JAX's 64-bit mode is off (for this thread)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(False)
    from jax.experimental import disable_x64  # jax < 0.8

    return disable_x64()


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
        return self.compact_and_aligned and (PERMUTED_ZERO_COPY or not self.permuted)


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
