"""Abstract values: torch tensor signatures as JAX shapes and dtypes, and back."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import torch

#: A shape and a dtype.
Aval = tuple[tuple[int, ...], np.dtype]

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
_NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in _TORCH_TO_NUMPY.items()}


def jax_dtype(dtype: torch.dtype, *, where: str) -> np.dtype:
    """The JAX dtype of a torch dtype; `where` names the argument in errors."""
    try:
        result = _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise TypeError(
            f"{where}: torch dtype {dtype} has no JAX equivalent bridge_mr supports (supported: "
            f"{', '.join(str(d).removeprefix('torch.') for d in _TORCH_TO_NUMPY)}). Convert the "
            "tensor with .to(...) first."
        ) from None
    if jax.dtypes.canonicalize_dtype(result) != result:
        raise TypeError(
            f"{where}: a {dtype} tensor needs JAX's 64-bit mode, which is off, so JAX would "
            "silently compute in 32 bits. Enable it with jax.config.update('jax_enable_x64', "
            "True) before any JAX work, or convert the tensor to a 32-bit dtype."
        )
    return result


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a JAX output dtype."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"a JAX output of dtype {dtype} has no torch equivalent; return one of "
            f"{', '.join(str(d) for d in _NUMPY_TO_TORCH)} from the JAX function."
        ) from None


def is_differentiable(dtype: np.dtype) -> bool:
    """Whether values of this JAX dtype carry gradients between torch and JAX (real floats)."""
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))
