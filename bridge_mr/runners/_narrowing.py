"""64-bit integer tensors for int32 / uint32 inputs (x64 off), cast on their device.

For runners whose programs take torch tensors on the device itself (torch-xla's lazy graph,
TorchTPU's kernels), not through DLPack (which narrows in `bridge_mr.dlpack.jit_arguments`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from bridge_mr import _dtypes
from bridge_mr._dtypes import Aval


def positional(index: int) -> str:
    """What an error calls the tensor input at `index` when the caller gave no names."""
    return f"tensors[{index}]"


def narrowable(avals: Sequence[Aval]) -> tuple[int, ...]:
    """The inputs a 64-bit integer tensor may be given for (x64 off): those of int32 / uint32."""
    return tuple(i for i, (_, dtype) in enumerate(avals) if dtype in _dtypes.NARROW_TARGETS)


def narrow(inputs: list[Any], indices: Sequence[int], names: Sequence[str] | None) -> list[Any]:
    """`inputs` with each int64 / uint64 tensor among `indices` cast to int32 / uint32.

    Their values are checked first, all with one device read (the sync); `names`: what an
    error calls each input (default `positional`).

    Raises:
      ValueError: a value does not fit (`bridge_mr._dtypes.check_narrowable`).
    """
    if not indices:
        return inputs
    name_of: Callable[[int], str] = positional if names is None else names.__getitem__
    targets = {i: _dtypes.narrowed(inputs[i].dtype) for i in indices}
    wide = {i: target for i, target in targets.items() if target is not None}
    if not wide:
        return inputs
    found = torch.stack([_dtypes.extremes(inputs[i]) for i in wide]).cpu().tolist()
    narrowed = list(inputs)
    for (i, target), (low, high) in zip(wide.items(), found, strict=True):
        _dtypes.check_narrowable(name_of(i), inputs[i].dtype, low, high)
        narrowed[i] = inputs[i].to(target)
    return narrowed
