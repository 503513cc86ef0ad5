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
* 64-bit dtypes need JAX's x64 mode. With it off (`narrowed`, the one x64 policy):
  int64 and uint64 tensors cross as int32 / uint32 when their values fit, checked by one
  min / max reduction (`extremes`, `check_narrowable`) and a ValueError naming the value when
  they do not; JAX then computes in the 32-bit dtype, as with a numpy int64 array (which it
  narrows unchecked). The 64-bit floats and complex128 are an error (`x64_error`), never a
  silent downcast; only `bridge_mr.dlpack`'s `allow_x64_downcast=True` converts them to their
  32-bit dtype (`narrow`). Either conversion is one counted copy.
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
    "NARROW_TARGETS",
    "Aval",
    "DtypeInfo",
    "check_narrowable",
    "extremes",
    "is_differentiable",
    "jax_dtype",
    "narrowed",
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
    def narrows_when_x64_off(self) -> bool:
        """Whether it crosses as `narrow` while x64 is off, its values checked (int64, uint64).

        The other 64-bit dtypes (float64, complex128) are refused then instead: narrowing an
        integer is exact or an error, narrowing a float would lose precision silently.
        """
        return self.narrow is not None and not (self.torch.is_floating_point or self.is_complex)

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

#: The JAX dtypes 64-bit integer tensors cross as while x64 is off (int32, uint32): a program
#: input of one of these dtypes may be given a tensor that `narrowed` narrows.
NARROW_TARGETS: frozenset[np.dtype] = frozenset(
    DTYPES[info.narrow].jax
    for info in DTYPES.values()
    if info.narrow is not None and info.narrows_when_x64_off
)


def narrowed(dtype: torch.dtype) -> torch.dtype | None:
    """The 32-bit dtype a tensor of `dtype` crosses to JAX as now, or None for its own dtype.

    The x64 policy: while JAX's x64 mode is off, int64 and uint64 tensors cross as int32 and
    uint32 (`narrows_when_x64_off`), after `check_narrowable` on their `extremes`. The 64-bit
    floats and complex128 do not narrow (None): with x64 off they are refused (`jax_dtype`).

    Args:
      dtype: the tensor's torch dtype.

    Returns:
      The narrower torch dtype, or None where the tensor crosses as it is (or not at all).
    """
    info = DTYPES.get(dtype)
    if info is None or not info.narrows_when_x64_off or _jax_compat.x64_enabled():
        return None
    return info.narrow


def jax_dtype(dtype: torch.dtype, *, where: str, xla: bool = False) -> np.dtype:
    """The JAX dtype of a torch dtype, for a value about to cross to JAX.

    Args:
      dtype: the torch dtype.
      where: names the value in error messages (e.g. "tensors[2]" or "args[0]['w']").
      xla: the value crosses inside a torch-xla graph (which also takes float8) rather than by
        DLPack.

    Returns:
      The numpy / ml_dtypes dtype JAX uses for it: for int64 / uint64 while JAX's x64 mode is
      off, int32 / uint32 (`narrowed`; the values are checked when the tensor crosses).

    Raises:
      TypeError: the dtype cannot cross this way, or it is a 64-bit float or complex dtype
        while JAX's x64 mode is off (`x64_error`).
    """
    info = DTYPES.get(dtype)
    if info is None or not (info.xla if xla else info.dlpack):
        raise unsupported_error(where, dtype, xla=xla)
    narrow = narrowed(dtype)
    if narrow is not None:
        return DTYPES[narrow].jax
    if info.needs_x64 and not _jax_compat.x64_enabled():
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
    """The error for a float64 / complex128 value while x64 is off: bridge_mr never downcasts.

    (int64 and uint64 values narrow instead, checked: `narrowed`.)

    Args:
      where: names the value (e.g. "tensors[0]").
      dtype: its torch dtype (float64 or complex128).
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


def extremes(tensor: torch.Tensor) -> torch.Tensor:
    """The minimum and maximum of an int64 or uint64 tensor, for `check_narrowable`.

    One reduction on the tensor's device; nothing is read back (reading is the caller's sync).

    Args:
      tensor: an int64 or uint64 tensor, of any layout or device.

    Returns:
      An int64 tensor [min, max] on the tensor's device; [0, 0] for an empty tensor. A uint64
      tensor is reduced through its int64 view (torch has no uint64 min / max), so values from
      2**63 up read as negative; `check_narrowable` reads them back as they are.
    """
    if tensor.numel() == 0:  # aminmax refuses empty tensors: they hold no value out of range.
        return torch.zeros(2, dtype=torch.int64, device=tensor.device)
    if tensor.dtype == torch.uint64:
        tensor = tensor.view(torch.int64)
    if tensor.device.type == "xla":
        # torch-xla 2.9 runs aminmax on the host (a device read per tensor); XLA fuses these.
        return torch.stack((tensor.min(), tensor.max()))
    low, high = torch.aminmax(tensor)
    return torch.stack((low, high))


def check_narrowable(where: str, dtype: torch.dtype, low: int, high: int) -> None:
    """Raises unless values from `low` to `high` fit the dtype a `dtype` tensor narrows to.

    Args:
      where: names the value (e.g. "tree['labels']" or "map_reduce: argument clients['y']").
      dtype: its torch dtype (one that `narrowed` narrows).
      low: its minimum, as `extremes` gives it.
      high: its maximum, as `extremes` gives it.

    Raises:
      ValueError: a value lies outside the narrower dtype's range; the message names the
        value, the value(s) out of range, the range and the fixes.
    """
    info = DTYPES[dtype]
    assert info.narrow is not None  # Only narrowing dtypes are checked.
    bounds = torch.iinfo(info.narrow)
    if bounds.min <= low and high <= bounds.max:
        return
    unsigned = dtype == torch.uint64
    offending = [
        # A uint64 value from 2**63 up reads as negative in `extremes`' int64 view.
        value + 2**64 if unsigned and value < 0 else value
        for value in dict.fromkeys((low, high))
        if not bounds.min <= value <= bounds.max
    ]
    raise ValueError(
        f"{where}: a {dtype} tensor crosses to JAX as {DTYPES[info.narrow].jax} while JAX's "
        f"64-bit mode is off, so its values must lie in [{bounds.min}, {bounds.max}]; it holds "
        f"{' and '.join(map(str, offending))}. Fix: enable x64 with "
        f'jax.config.update("jax_enable_x64", True) before any JAX work, or bring the values '
        f"into that range (e.g. renumber the ids) before the call."
    )
