"""The one torch <-> JAX dtype table, with what each dtype can do, and the one x64 policy.

Every bridge_mr layer that maps dtypes (the DLPack converters, `torch_function`, the torch-xla
runner) reads this table, so a dtype is accepted or refused for the same reason everywhere.

Decisions, per dtype (checked on torch 2.9.0 / 2.13.0 with jax 0.10.2):

* bool, the signed and unsigned integers of 8 to 64 bits (uint16 / uint32 / uint64 included:
  DLPack carries them without a copy on both torch versions), float16, bfloat16, float32,
  float64, complex64 and complex128 cross everywhere: by DLPack on CPU / CUDA and inside a
  torch-xla graph.
* float8_e4m3fn and float8_e5m2 cross on torch-xla only. torch 2.9's DLPack export refuses
  float8 ("float8 types are not supported by dlpack"); rather than a dtype whose support
  depends on the torch version, the DLPack path refuses them on every version.
* Everything else (complex32, the other float8 / float4 formats, quantized and bit dtypes) is
  refused: JAX or DLPack lack them.
* 64-bit dtypes need JAX's x64 mode. With it off they are an error (`x64_error`), never a
  silent downcast; only `bridge_mr.dlpack`'s `allow_x64_downcast=True` converts them to their
  32-bit dtype (`narrow`), with one counted copy.
* Only real floating dtypes carry gradients (`is_differentiable`).

This module imports torch, numpy, ml_dtypes and jax; only torch-side layers import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from bridge_mr._compat import jax as _jax_compat

__all__ = [
    "DTYPES",
    "Aval",
    "DtypeInfo",
    "is_differentiable",
    "jax_dtype",
    "torch_dtype",
    "unsupported_error",
    "x64_error",
]

#: A shape and a dtype.
Aval = tuple[tuple[int, ...], np.dtype]


@dataclasses.dataclass(frozen=True)
class DtypeInfo:
    """What one torch dtype is on the JAX side, and where it can go.

    Attributes:
      torch: the torch dtype.
      jax: the JAX (numpy / ml_dtypes) dtype of the same bits.
      dlpack: crosses between CPU / CUDA tensors and JAX arrays by DLPack, zero-copy.
      xla: a torch-xla tensor can hold it (so the torch-xla runner can pass it to JAX).
      numpy: `torch.Tensor.numpy()` views it as `jax` (numpy has the dtype).
      narrow: for a 64-bit dtype (which needs JAX's x64 mode), its 32-bit counterpart; None
        for the others.
    """

    torch: torch.dtype
    jax: np.dtype
    dlpack: bool
    xla: bool
    numpy: bool
    narrow: torch.dtype | None = None

    @property
    def needs_x64(self) -> bool:
        """Whether JAX represents this dtype only with its 64-bit mode on."""
        return self.narrow is not None

    @property
    def is_complex(self) -> bool:
        """Whether the dtype is complex (torch tensors may carry a lazy conjugation bit)."""
        return self.torch.is_complex

    @property
    def differentiable(self) -> bool:
        """Whether values of this dtype carry gradients between torch and JAX (real floats)."""
        return self.torch.is_floating_point


def _entry(
    dtype: torch.dtype,
    jax: type | np.dtype,
    *,
    dlpack: bool = True,
    numpy: bool = True,
    narrow: torch.dtype | None = None,
) -> tuple[torch.dtype, DtypeInfo]:
    return dtype, DtypeInfo(dtype, np.dtype(jax), dlpack, True, numpy, narrow)


#: Every torch dtype bridge_mr maps, by torch dtype.
DTYPES: Mapping[torch.dtype, DtypeInfo] = dict(
    [
        _entry(torch.bool, np.bool_),
        _entry(torch.uint8, np.uint8),
        _entry(torch.uint16, np.uint16),
        _entry(torch.uint32, np.uint32),
        _entry(torch.uint64, np.uint64, narrow=torch.uint32),
        _entry(torch.int8, np.int8),
        _entry(torch.int16, np.int16),
        _entry(torch.int32, np.int32),
        _entry(torch.int64, np.int64, narrow=torch.int32),
        _entry(torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, dlpack=False, numpy=False),
        _entry(torch.float8_e5m2, ml_dtypes.float8_e5m2, dlpack=False, numpy=False),
        _entry(torch.float16, np.float16),
        _entry(torch.bfloat16, ml_dtypes.bfloat16, numpy=False),
        _entry(torch.float32, np.float32),
        _entry(torch.float64, np.float64, narrow=torch.float32),
        _entry(torch.complex64, np.complex64),
        _entry(torch.complex128, np.complex128, narrow=torch.complex64),
    ]
)

_BY_JAX: dict[np.dtype, torch.dtype] = {info.jax: dtype for dtype, info in DTYPES.items()}
_DLPACK = tuple(str(dtype) for dtype, info in DTYPES.items() if info.dlpack)
_XLA = tuple(str(dtype) for dtype, info in DTYPES.items() if info.xla and not info.dlpack)


def jax_dtype(dtype: torch.dtype, *, where: str, xla: bool = False) -> np.dtype:
    """The JAX dtype of a torch dtype, for a value about to cross to JAX.

    Args:
      dtype: the torch dtype.
      where: names the value in error messages (e.g. "tensors[2]" or "args[0]['w']").
      xla: the value crosses inside a torch-xla graph (which also takes float8) rather than by
        DLPack.

    Returns:
      The numpy / ml_dtypes dtype JAX uses for it.

    Raises:
      TypeError: the dtype cannot cross this way, or it is a 64-bit dtype while JAX's x64 mode
        is off (`x64_error`).
    """
    info = DTYPES.get(dtype)
    if info is None or not (info.xla if xla else info.dlpack):
        raise unsupported_error(where, dtype, xla=xla)
    if info.narrow is not None and not _jax_compat.x64_enabled():
        raise x64_error(where, dtype)
    return info.jax


def unsupported_error(where: str, dtype: torch.dtype, *, xla: bool = False) -> TypeError:
    """The error for a torch dtype that cannot cross to JAX this way (see `jax_dtype`).

    Args:
      where: names the value (e.g. "tensors[0]").
      dtype: its torch dtype.
      xla: the value was to cross inside a torch-xla graph rather than by DLPack.

    Returns:
      The TypeError to raise.
    """
    info = DTYPES.get(dtype)
    supported = _DLPACK + _XLA if xla else _DLPACK
    also = " (it crosses on torch-xla devices only)" if info is not None and info.xla else ""
    return TypeError(
        f"{where}: expected a tensor of a dtype JAX shares with torch, got a {dtype} "
        f"tensor{also}. Fix: cast it with .to(...) to one of {', '.join(supported)}."
    )


def torch_dtype(dtype: np.dtype | type) -> torch.dtype:
    """The torch dtype of a JAX dtype (of an output about to become a torch tensor).

    Args:
      dtype: a numpy / ml_dtypes dtype, or anything `np.dtype` accepts.

    Returns:
      The torch dtype of the same bits.

    Raises:
      TypeError: torch has no such dtype (e.g. int4, float0) or bridge_mr does not map it.
    """
    try:
        return _BY_JAX[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(
            f"expected a JAX value of a dtype torch has, got one of dtype {dtype}. Fix: cast "
            f"it in JAX before returning it, e.g. x.astype(jnp.float32); torch takes "
            f"{', '.join(str(np.dtype(d)) for d in _BY_JAX)}."
        ) from None


def is_differentiable(dtype: np.dtype | type) -> bool:
    """Whether values of this JAX dtype carry gradients between torch and JAX (real floats)."""
    return jnp.issubdtype(dtype, np.floating)


def x64_error(where: str, dtype: torch.dtype, *, downcast_option: str | None = None) -> TypeError:
    """The error for a 64-bit value while JAX's x64 mode is off: bridge_mr never downcasts.

    Args:
      where: names the value (e.g. "tensors[0]").
      dtype: its torch dtype (one with a `narrow` counterpart).
      downcast_option: the name of a keyword argument of the caller that opts into converting
        to the 32-bit dtype instead (`allow_x64_downcast`), to mention as a fix; None if none.

    Returns:
      The TypeError to raise.
    """
    info = DTYPES.get(dtype)
    narrow = info.narrow if info is not None and info.narrow is not None else torch.float32
    option = (
        f", pass {downcast_option}=True to convert it to {narrow} (one copy)"
        if downcast_option
        else ""
    )
    return TypeError(
        f"{where} has dtype {dtype}; expected a dtype of at most 32 bits while JAX's 64-bit mode "
        f"is off (JAX would compute in {narrow}, and bridge_mr never downcasts silently). Fix: "
        f'enable x64 with jax.config.update("jax_enable_x64", True) before any JAX work'
        f"{option}, or cast the tensor yourself with .to({narrow})."
    )
