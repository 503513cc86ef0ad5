"""Packed sequences inside `from_torch`: the padded batch and its lengths, never packed data.

A `PackedSequence`'s data is as long as the sum of the sequence lengths, and inside `from_torch`
the lengths are traced values, so that shape is unknown when the program is built. torch's
`pack_padded_sequence` / `pad_packed_sequence` and its recurrent modules reach the data only
through `torch._VF._pack_padded_sequence`, `_VF._pad_packed_sequence` and `_VF.lstm` / `gru` /
`rnn_tanh` / `rnn_relu`; `_recurrent`'s dispatch intercepts those calls. Packing returns two
stand-ins in place of `data` and `batch_sizes`: `PackedData` holds the padded batch, time first,
in the order torch packs it (sorted by length when `enforce_sorted=False`: torch sorts it with
tensor ops, which trace), and `BatchSizes` holds the lengths. A recurrent layer given them runs a
masked scan over the padded batch (`_recurrent`), unpacking masks what lies past each length.
Anything else that reaches a stand-in (`packed.data` in a loss, `packed.batch_sizes` read, an op
torch's code paths above do not use) is refused with `UnsupportedTorchOperation`.

torch checks lengths (positive, at most the padded length, decreasing under
`enforce_sorted=True`) when it packs; here they are checked when their values are known: a
Python list (also under `jax.jit`: `constant`), or any lengths in an eager call. Traced lengths
cannot be checked under `jax.jit`: a zero length gives the initial state and no outputs, a
length above the padded length acts as that length, and unsorted lengths with
`enforce_sorted=True` give what `enforce_sorted=False` gives (where torch raises for each).
Unpacking traced lengths needs `total_length`: torch pads to the longest length, a traced value.

`nn.utils.rnn.pad_sequence` (which `pack_sequence` calls) is computed here as pads and a stack:
torch's own C++ kernel writes each sequence into a slice of a new output tensor, below
functionalization, and those writes into torchax's copies of the slices were lost (`_aliases`
now carries such writes to their base; pads and a stack remain the simpler program).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torch as torch_compat
from bridge_mr._compat import torchax as torchax_compat

__all__ = [
    "BatchSizes",
    "PackedData",
    "Refuse",
    "constant",
    "inner",
    "is_pack",
    "is_pad_sequence",
    "is_unpack",
    "pack",
    "pad_sequence",
    "stand_in",
    "unpack",
]

# torch.nn.utils.rnn calls these through `torch._VF` (torch 2.9 - 2.13); they reach the function
# mode as the builtins `torch._pack_padded_sequence` / `torch._pad_packed_sequence`.
_PACK, _UNPACK = "_pack_padded_sequence", "_pad_packed_sequence"


def _is_torch_function(func: Any, name: str) -> bool:
    return getattr(func, "__name__", None) == name and getattr(func, "__module__", None) == "torch"


def is_pack(func: Any) -> bool:
    """Whether `func` is what `pack_padded_sequence` calls to pack."""
    return _is_torch_function(func, _PACK)


def is_pad_sequence(func: Any) -> bool:
    """Whether `func` is what `nn.utils.rnn.pad_sequence` (and `pack_sequence`) calls to pad."""
    return func is torch_compat.pad_sequence


def is_unpack(func: Any) -> bool:
    """Whether `func` is what `pad_packed_sequence` calls to unpack."""
    return _is_torch_function(func, _UNPACK)


class Refuse:
    """Raises `error` for a use of a packed sequence, naming it and the user's line."""

    __slots__ = ("error", "where")

    def __init__(self, error: type[Exception], where: Callable[[], str]) -> None:
        self.error, self.where = error, where

    def __call__(self, what: str, fix: str | None = None) -> NoReturn:
        """Raises for `what` (the call, what it expected, what it got), with `fix` or else
        the general one: compute on the padded tensor."""
        general = (
            "bridge_mr.from_torch supports a packed sequence only as pack_padded_sequence (or "
            "pack_sequence) -> nn.LSTM / nn.GRU / nn.RNN -> pad_packed_sequence and the "
            "layers' final states. Inside from_torch the lengths are traced values, so the "
            "packed data (as long as their sum) is never built: the packed sequence holds the "
            "padded batch and the lengths. Fix: unpack with nn.utils.rnn.pad_packed_sequence("
            "packed, batch_first=..., total_length=...) and compute on the padded tensor, "
            "masking positions past each length (the returned lengths), instead of reading "
            "packed.data or packed.batch_sizes."
        )
        raise self.error(f"{what} at {self.where()}: {general if fix is None else fix}")


#: The fix for a PackedSequence built from tensors rather than by `pack_padded_sequence`.
BY_HAND = (
    "Fix: build it with nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=..., "
    "enforce_sorted=False) from the padded batch (nn.utils.rnn.pad_sequence pads a list)."
)


class _StandIn:
    """Base of the stand-ins: any torch function given one reaches `_recurrent`'s dispatch
    (torchax's function mode sees it first), which refuses all but pack, unpack and the layers."""

    __slots__ = ("_refuse",)

    def __init__(self, refuse: Refuse) -> None:
        self._refuse = refuse

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented  # only outside from_torch, where no stand-in is made

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # protocol probes (copy, pickle, numpy) see no such hook
        self._refuse(f"{self._name}.{name}")

    def __getitem__(self, index: Any) -> Any:
        self._refuse(f"{self._name}[{index!r}]")

    def __len__(self) -> int:
        self._refuse(f"len({self._name})")

    def __iter__(self) -> Any:
        self._refuse(f"iterating over {self._name}")

    def __repr__(self) -> str:
        return f"<{self._name}: bridge_mr.from_torch's stand-in, see torch_fn/_packed.py>"

    @property
    def _name(self) -> str:
        return "packed.data"


class PackedData(_StandIn):
    """`PackedSequence.data`: `padded` [time, batch, *], in the packed order."""

    __slots__ = ("padded",)

    def __init__(self, padded: torch.Tensor, refuse: Refuse) -> None:
        super().__init__(refuse)
        self.padded = padded

    # What torch's modules read of their input: its dtype, device, rank and features.
    @property
    def dtype(self) -> torch.dtype:
        return self.padded.dtype

    @property
    def device(self) -> torch.device:
        return self.padded.device

    def dim(self) -> int:
        return self.padded.dim() - 1

    def size(self, dim: int | None = None) -> int:
        rank = self.padded.dim() - 1
        if dim is not None and rank > 1 and dim in (-1, rank - 1):
            return self.padded.size(-1)
        self._refuse(f"packed.data.size({'' if dim is None else dim})")


class BatchSizes(_StandIn):
    """`PackedSequence.batch_sizes`: the `lengths` (a traced tensor, in the packed order), the
    batch size, the padded length `time`, and the longest length where it is known."""

    __slots__ = ("batch", "lengths", "longest", "time")

    def __init__(
        self, lengths: torch.Tensor, time: int, longest: int | None, refuse: Refuse
    ) -> None:
        super().__init__(refuse)
        self.lengths, self.batch, self.time, self.longest = lengths, lengths.size(0), time, longest

    @property
    def _name(self) -> str:
        return "packed.batch_sizes"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # torch's PackedSequence checks batch_sizes is on the CPU

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index == 0:
            return self.batch  # the recurrent modules' batch size (of their initial state)
        self._refuse(f"packed.batch_sizes[{index!r}]")

    def size(self, dim: int | None = None) -> int:
        if dim not in (0, -1):
            self._refuse(f"packed.batch_sizes.size({'' if dim is None else dim})")
        return padded_length(self.time, self._refuse) if self.longest is None else self.longest


def stand_in(tree: Any) -> _StandIn | None:
    """The first stand-in among `tree`'s leaves (tuples, lists and dicts), or None."""
    if isinstance(tree, _StandIn):
        return tree
    items = tree.values() if isinstance(tree, dict) else tree
    if isinstance(tree, (tuple, list, dict)):
        for item in items:
            found = stand_in(item)
            if found is not None:
                return found
    return None


def constant(func: Any, args: Sequence[Any]) -> bool:
    """Whether `func(*args)` makes lengths from a Python list: `torch.as_tensor` of ints, or
    `torch.sort` of such a tensor (`pack_padded_sequence` does both for a list). Run under
    `jax.ensure_compile_time_eval`, they stay values under `jax.jit` (else every op is traced),
    so `pack` can check them as torch does and unpack to the longest length."""
    if func is torch.as_tensor:
        listed = args[0] if args else None
        return isinstance(listed, (list, tuple)) and all(type(v) is int for v in listed)
    if func is torch.sort and args and isinstance(args[0], torch.Tensor):
        return args[0].dim() == 1 and _values(args[0]) is not None
    return False


def inner(tensor: torch.Tensor) -> torch.Tensor:
    """The torchax tensor a functionalization wrapper holds, or `tensor` itself."""
    if torch_compat.is_functional_tensor(tensor):
        return torch_compat.functional_inner(tensor)
    return tensor


def _values(tensor: torch.Tensor) -> np.ndarray | None:
    """A tensor's values when they are known as the program is built, else None."""
    value = torchax_compat.value_of(inner(tensor))
    return np.asarray(value) if type(value) is jax_compat.ArrayImpl else None


def pad_sequence(args: Sequence[Any], kwargs: dict[str, Any] | None) -> torch.Tensor:
    """What `nn.utils.rnn.pad_sequence` (and `pack_sequence`) calls to pad, as pads and a stack
    (see the module docstring)."""
    names = ("sequences", "batch_first", "padding_value", "padding_side")
    bound = dict(zip(names, args, strict=False)) | (kwargs or {})
    sequences = bound["sequences"]
    value, side = bound.get("padding_value", 0.0), bound.get("padding_side", "right")
    longest = max(s.size(0) for s in sequences)
    padded = []
    for s in sequences:
        gap = (0, longest - s.size(0)) if side == "right" else (longest - s.size(0), 0)
        padded.append(torch.nn.functional.pad(s, (0, 0) * (s.dim() - 1) + gap, value=value))
    return torch.stack(padded, 0 if bound.get("batch_first", False) else 1)


def _arguments(
    args: Sequence[Any], kwargs: dict[str, Any] | None, names: Sequence[str]
) -> list[Any]:
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs or {})
    return [bound[name] for name in names]


def pack(
    refuse: Refuse, args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[PackedData, BatchSizes]:
    """`_VF._pack_padded_sequence(input, lengths, batch_first)`: the stand-ins of `data` and
    `batch_sizes`. `lengths` is an int64 tensor (torch converts a list), in decreasing order
    (torch has sorted the batch by it unless `enforce_sorted=True`)."""
    input, lengths, batch_first = _arguments(args, kwargs, ("input", "lengths", "batch_first"))
    if input.dim() < 2:
        refuse(
            f"pack_padded_sequence of a {input.dim()}-D tensor (expected [time, batch, *] or "
            f"[batch, time, *])",
            "Fix: add the batch axis (x.unsqueeze(1), or 0 with batch_first=True).",
        )
    padded = input.transpose(0, 1) if batch_first else input
    time, batch = padded.size(0), padded.size(1)
    if lengths.dim() != 1 or lengths.size(0) != batch:
        refuse(
            f"pack_padded_sequence with lengths of shape {tuple(lengths.shape)} for a batch of "
            f"{batch} (expected one length per sequence, shape ({batch},))",
            "Fix: pass one length per sequence of the batch (torch raises here too).",
        )
    values = _values(lengths)
    longest = None
    if values is not None:
        # torch's own checks, where the values are known.
        if (values <= 0).any() or (values > time).any():
            refuse(
                f"pack_padded_sequence with lengths {values.tolist()} (expected each in 1.."
                f"{time}, the padded length; torch raises for a length of 0 or above it)",
                "Fix: leave empty sequences out of the batch and keep each length at most the "
                "padded length (torch raises here too).",
            )
        if (np.diff(values) > 0).any():
            refuse(
                f"pack_padded_sequence with lengths {values.tolist()} not in decreasing order "
                f"and enforce_sorted=True (expected decreasing lengths; torch raises here too)",
                "Fix: pass enforce_sorted=False (torch then sorts the batch and restores its "
                "order on unpacking).",
            )
        longest = int(values.max())
    return PackedData(padded, refuse), BatchSizes(lengths, time, longest, refuse)


class _PaddedLength(int):
    """`batch_sizes.size(0)` (the longest length) when the lengths are traced: `pad_packed_sequence`
    takes it as its output length unless `total_length` is given; given, it compares them."""

    refuse: Refuse

    def __gt__(self, total_length: object) -> bool:
        # `total_length < max_seq_length`: Python asks this subclass first.
        if isinstance(total_length, int) and total_length < int(self):
            self.refuse(
                f"pad_packed_sequence(total_length={total_length}) of traced lengths (expected "
                f"total_length >= {int(self)}, the padded length, as torch needs at least the "
                f"longest length, unknown here)",
                f"Fix: pass total_length={int(self)} and slice the result if you need fewer steps.",
            )
        return False


def unpack(
    refuse: Refuse, args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_VF._pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)`:
    the padded tensor (in the packed order; torch reorders it next) and the lengths."""
    names = ("data", "batch_sizes", "batch_first", "padding_value", "total_length")
    data, sizes, batch_first, padding_value, total = _arguments(args, kwargs, names)
    if not isinstance(data, PackedData) or not isinstance(sizes, BatchSizes):
        refuse(
            "pad_packed_sequence of a PackedSequence made by hand (expected one from "
            "pack_padded_sequence)",
            BY_HAND,
        )
    if isinstance(total, _PaddedLength):
        refuse(
            "pad_packed_sequence of traced lengths without total_length (expected "
            "total_length; torch pads to the longest length, a traced value here)",
            f"Fix: pass total_length={sizes.time}, the padded length (the result is then "
            f"torch's, padded to it).",
        )
    out = data.padded
    time, lengths = out.size(0), sizes.lengths
    if total <= time:
        out = out[:total]
    else:
        out = torch.nn.functional.pad(out, (0, 0) * (out.dim() - 1) + (0, total - time))
    # Positions 1..total against each length: valid where position <= length.
    position = lengths.new_ones((total, 1)).cumsum(0)
    valid = (position <= lengths.unsqueeze(0)).reshape(total, -1, *[1] * (out.dim() - 2))
    out = out.masked_fill(~valid, padding_value)
    return (out.transpose(0, 1) if batch_first else out), lengths


def padded_length(time: int, refuse: Refuse) -> int:
    """`batch_sizes.size(0)` of traced lengths (see `_PaddedLength`)."""
    length = _PaddedLength(time)
    length.refuse = refuse
    return length
