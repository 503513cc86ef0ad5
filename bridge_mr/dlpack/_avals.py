"""The shape and dtype a torch tensor crosses to JAX as: its aval, named for error messages."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bridge_mr._dtypes import Aval, jax_dtype


def tensor_avals(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> tuple[Aval, ...]:
    """The (shape, JAX dtype) of each tensor, as a program traced for it takes it.

    A torch-xla tensor crosses inside torch-xla's graph (which also takes float8); any other
    by DLPack. While JAX's x64 mode is off, int64 / uint64 give int32 / uint32
    (`bridge_mr._dtypes.jax_dtype`).

    Args:
      tensors: the tensors.
      names: what an error calls each tensor (e.g. "map_reduce: argument server['w']").

    Returns:
      One `(shape, numpy dtype)` per tensor.

    Raises:
      TypeError: a tensor's dtype cannot cross (a quantized dtype, or float64 / complex128 while
        x64 is off); the message starts with the tensor's name.

    Example:
      >>> bridge_mr.dlpack.tensor_avals([torch.zeros(2, 3)], ["x"])
      (((2, 3), dtype('float32')),)
    """
    return tuple(
        (tuple(t.shape), jax_dtype(t.dtype, where=name, xla=t.device.type == "xla"))
        for t, name in zip(tensors, names, strict=True)
    )
