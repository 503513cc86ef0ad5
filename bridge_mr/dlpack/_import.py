"""torch tensors -> JAX arrays.

A compact, 64-byte-aligned CPU or CUDA tensor of a supported dtype (`bridge_mr._dtypes`, the
`dlpack` column) becomes a JAX array that shares its memory: no copy. Compact means row-major,
or permuted-dense (e.g. transposed) where JAX's backend reads such tensors correctly (checked
once per device type; jaxlib 0.10.2's CPU backend does). Any other supported tensor is copied
once into a fresh contiguous buffer first, and the copy is counted (`count_conversions`). A
CUDA tensor is shared with the JAX GPU of the same index, with JAX's reads ordered after the
work queued on torch's current stream.

64-bit tensors while JAX's x64 mode is off (`bridge_mr._dtypes.narrowed`): an int64 or uint64
tensor is copied once, counted, into an int32 / uint32 buffer after one min / max reduction
checks that its values fit (a ValueError names the tensor and the value otherwise); a float64 or
complex128 tensor is an error unless the caller passes `allow_x64_downcast=True`.

Aliasing: a shared-memory JAX array is a view of the torch tensor. It is valid only while
nobody writes to the tensor, and because JAX dispatches asynchronously, a caller that runs JAX
computations on it must block on their results before returning control to code that may write
to the tensor (in place, `resize_`, `set_`, or an optimizer step). Deleting either side is safe:
the JAX array keeps the torch storage alive and vice versa.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch

from bridge_mr import _caches, _dtypes
from bridge_mr._compat import torch as _torch_compat

from . import _owed, _runtime
from ._stats import ACTIVE, record

_WIDE = 1  # a 64-bit dtype, which needs JAX's x64 mode
_COMPLEX = 2  # may carry torch's lazy conjugation bit

#: torch dtypes that cross by DLPack unchanged (`bridge_mr._dtypes`), with the flags above.
_FLAGS: dict[torch.dtype, int] = {
    dtype: (_WIDE if info.needs_x64 else 0) | (_COMPLEX if info.is_complex else 0)
    for dtype, info in _dtypes.DTYPES.items()
    if info.dlpack
}

#: Start-address alignment needed to share a buffer. JAX's CPU backend aliases only 64-byte
#: aligned buffers (it silently copies others). Its GPU backend aliases any start address, but
#: XLA's GPU kernels assume aligned parameters, so misaligned CUDA tensors are copied as well.
ALIGNMENT = 64

_STRIDED = torch.strided
_EXPECTED = "a dense (strided) CPU or CUDA torch.Tensor of a dtype JAX supports"


def import_tensors(
    tensors: Sequence[torch.Tensor], *, allow_x64_downcast: bool = False
) -> list[jax.Array]:
    """Converts torch tensors to JAX arrays, sharing memory where the layout allows.

    The flat-list entry point of `to_jax` for callers that have already flattened their
    arguments; the rules are those of `to_jax`.

    Args:
      tensors: the tensors.
      allow_x64_downcast: as for `to_jax`.

    Returns:
      One JAX array per tensor.

    Raises:
      TypeError: an element is not a supported tensor (the message names `tensors[i]`).
      ValueError: an int64 / uint64 tensor holds a value outside int32 / uint32 while JAX's
        x64 mode is off.

    Example:
      >>> x = torch.arange(3.0)
      >>> [array] = bridge_mr.dlpack.import_tensors([x])
      >>> array, array.unsafe_buffer_pointer() == x.data_ptr()  # shares x's memory
      (Array([0., 1., 2.], dtype=float32), True)
      >>> bridge_mr.dlpack.import_tensors([torch.tensor([1, 2])])[0].dtype  # int64, x64 off
      dtype('int32')
    """
    return _import_all(tensors, allow_x64_downcast, _positional_name)


def to_jax(tree: Any, *, allow_x64_downcast: bool = False) -> Any:
    """Converts every torch tensor in a pytree to a JAX array; other leaves pass through.

    Each tensor becomes an array of the same shape and dtype on the matching JAX device
    (CPU -> the first JAX CPU device, `cuda:i` -> the JAX GPU with local id i). Tensors that
    require grad are detached. The result shares memory with the tensor when the tensor is
    compact (contiguous, or a permutation of contiguous) and its start is
    64-byte aligned; otherwise the tensor is copied once and the copy is counted
    (`count_conversions`). See the module docstring for how long a shared-memory array stays
    valid. A permuted tensor (`x.t()`, NHWC memory seen as NCHW) becomes an array in that
    layout, which computes right where it is; but jaxlib 0.10.2 computed on its copies made by
    `jax.device_put` (to another device, or with `may_alias=False`) as if they were row-major:
    pass `x.contiguous()` for an array you will move.

    While JAX's 64-bit mode is off, an int64 / uint64 tensor becomes an int32 / uint32 array:
    one min / max reduction checks that its values fit, then one counted copy narrows it (a
    CUDA tensor's check waits for its values). Cast such tensors to int32 yourself, or enable
    x64, to share them without the copy.

    Args:
      tree: a pytree (dicts, lists, tuples, namedtuples, None) of torch tensors and other leaves.
      allow_x64_downcast: with JAX's 64-bit mode off, convert float64 / complex128 tensors to
        float32 / complex64 (one counted copy) instead of raising.

    Returns:
      `tree` with each torch tensor replaced by its JAX array.

    Raises:
      TypeError: a tensor cannot be converted (sparse, quantized, nested, meta, torch-xla,
        unsupported dtype, or float64 / complex128 with x64 off and no `allow_x64_downcast`);
        the message names the leaf's path.
      ValueError: with x64 off, an int64 / uint64 tensor holds a value outside int32 / uint32;
        the message names the leaf's path, the value and the fixes.
      RuntimeError: a CUDA tensor was given but JAX has no GPU backend.

    Example:
      >>> bridge_mr.dlpack.to_jax({"step": 3, "w": torch.ones(2, requires_grad=True)})  # detached
      {'step': 3, 'w': Array([1., 1.], dtype=float32)}
      >>> bridge_mr.dlpack.to_jax(torch.zeros(2, dtype=torch.float64))  # x64 off
      Traceback (most recent call last):
      TypeError: ...float64...
      >>> bridge_mr.dlpack.to_jax(torch.zeros(2, dtype=torch.float64), allow_x64_downcast=True)
      Array([0., 0.], dtype=float32)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def name_of(k: int) -> str:
        return _tree_path(tree, positions[k])

    arrays = _import_all([leaves[i] for i in positions], allow_x64_downcast, name_of)
    for i, array in zip(positions, arrays, strict=True):
        leaves[i] = array
    return jax.tree_util.tree_unflatten(treedef, leaves)


def jit_arguments(
    tensors: Sequence[torch.Tensor], *, names: Sequence[str] | None = None
) -> Sequence[jax.Array | np.ndarray]:
    """Arguments for a jitted JAX call, sharing the tensors' memory: `import_tensors`, faster.

    While JAX's default device is a CPU device, a contiguous, 64-byte aligned CPU tensor of a
    dtype numpy has becomes a numpy view of it: jit's own argument path places such an array on
    the CPU device without copying, sooner than a DLPack import. Every other tensor is
    converted by `import_tensors`, with its rules, and so is every tensor while a
    `jax.transfer_guard` watches host-to-device transfers (jit would count a view as one); a
    CPU tensor imported so lands where jit places the views (a CPU device set with
    `jax.default_device`, else device 0). The same aliasing contract holds: block on the call's
    results before anyone may write to the tensors.

    Args:
      tensors: the tensors.
      names: what error messages call each tensor (e.g. "map_reduce: argument clients['y']");
        default `tensors[i]`.

    Returns:
      One numpy view or JAX array per tensor.

    Raises:
      TypeError: an element is not a supported tensor (the message names it).
      ValueError: an int64 / uint64 tensor holds a value outside int32 / uint32 while JAX's
        x64 mode is off (the message names it).

    Example:
      >>> x = torch.arange(3.0)
      >>> args = bridge_mr.dlpack.jit_arguments([x], names=["x"])
      >>> type(args[0]).__name__  # on CPU: a numpy view of x, which jit places without a copy
      'ndarray'
      >>> jax.jit(jnp.sum)(*args)
      Array(3., dtype=float32)
    """
    name_of = _positional_name if names is None else names.__getitem__
    # Inline, as this runs on every call of a torch function: whether jit places a numpy
    # argument on a CPU device (where it can share its memory), and whether a
    # `jax.transfer_guard` watches host-to-device transfers (jit would count a numpy view as
    # one, although it shares memory; a DLPack import does not count).
    device = _runtime.default_device()
    if device is not None:
        numpy_to_cpu = getattr(device, "platform", device) == "cpu"
    else:
        numpy_to_cpu = _runtime.default_platform() == "cpu"
    # Imports go where jit places the numpy views: a default CPU device set by
    # `jax.default_device`, else device 0. Elsewhere a program kept for the views' device
    # would refuse them.
    cpu = device if numpy_to_cpu and not isinstance(device, str) else None
    if not numpy_to_cpu or _runtime.transfer_guard_host_to_device() not in (None, "allow"):
        return _import_all(tensors, False, name_of, cpu)
    out: list[Any] = []
    imported: list[int] = []
    for index, tensor in enumerate(tensors):
        try:
            if tensor.dtype in _NUMPY_DTYPES and tensor.is_cpu and _shareable_as_is(tensor):
                out.append(tensor.detach().numpy())
                continue
        except _NOT_AS_IS:
            pass  # `import_tensors` takes it: it converts, copies or names the tensor.
        out.append(None)
        imported.append(index)
    if imported:
        arrays = _import_all(
            [tensors[i] for i in imported], False, lambda k: name_of(imported[k]), cpu
        )
        for index, array in zip(imported, arrays, strict=True):
            out[index] = array
    if ACTIVE and len(imported) < len(out):
        record(imports=len(out) - len(imported))
    return out


#: What the fast paths of `_import_all` and `jit_arguments` expect from a tensor they cannot
#: share as it is, which `_import_one` then handles or names: AttributeError (not a tensor),
#: KeyError (a dtype JAX lacks: `_shareable_as_is`), RuntimeError (torch: a tensor without
#: storage, such as a `torch.func` wrapper, or a nested tensor; jaxlib's `JaxRuntimeError`: a
#: buffer its backend refuses) and BufferError (DLPack's refusal to export a tensor). Any other
#: exception is a bug, and propagates.
_NOT_AS_IS = (AttributeError, KeyError, RuntimeError, BufferError)

#: torch dtypes whose tensors `Tensor.numpy()` views (numpy has them; bfloat16 it has not).
_NUMPY_DTYPES = frozenset(d for d in _FLAGS if _dtypes.DTYPES[d].numpy)


def _positional_name(index: int) -> str:
    return f"tensors[{index}]"


def _tree_path(tree: Any, leaf_index: int) -> str:
    path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][leaf_index]
    return "tree" + jax.tree_util.keystr(path)


def _import_all(
    tensors: Sequence[Any],
    allow_x64_downcast: bool,
    name_of: Callable[[int], str],
    cpu: Any = None,
) -> list[jax.Array]:
    """Each tensor as a JAX array; CPU tensors on the JAX CPU device `cpu` (None: device 0)."""
    out: list[jax.Array] = []
    append = out.append
    to_array = _runtime.capsule_to_array
    to_capsule = _runtime.tensor_to_capsule
    keep = _owed.record  # Each capsule's handle, so that exit waits for XLA to release it.
    cuda_ready: dict[int, tuple[Any, int | None]] = {}
    for index, tensor in enumerate(tensors):
        # Fast path for row-major tensors. Anything else (including a failure here that
        # `_NOT_AS_IS` expects) is redone by `_import_one`, which shares permuted layouts,
        # copies where needed, or raises an error that names the tensor.
        try:
            on_cpu = tensor.is_cpu
            if (on_cpu or tensor.is_cuda) and _shareable_as_is(tensor):
                alias = tensor.detach()  # `_owed.handle`, inline
                keep(alias)
                if on_cpu:
                    if cpu is None:
                        cpu = _runtime.jax_device("cpu", 0)
                    append(to_array(to_capsule(alias), cpu, None, _runtime.DL_CPU))
                else:
                    cuda_index = tensor.get_device()
                    device, stream = cuda_ready.get(cuda_index) or _cuda_ready(
                        cuda_index, cuda_ready
                    )
                    append(to_array(to_capsule(alias), device, stream, _runtime.DL_CUDA))
                continue
        except _NOT_AS_IS:
            pass
        append(_import_one(tensor, allow_x64_downcast, name_of, index, cuda_ready, cpu))
    if ACTIVE:
        record(imports=len(out))
    return out


def _shareable_as_is(tensor: torch.Tensor) -> bool:
    """Whether a tensor of a supported dtype can be shared row-major, with nothing to resolve.

    Row-major and 64-byte aligned, no lazy negative or conjugate bit, not a 64-bit dtype while
    JAX's x64 mode is off, and its memory holds its values (not a `__torch_dispatch__`
    subclass). Raises KeyError for a dtype JAX does not support.
    """
    flags = _FLAGS[tensor.dtype]
    return (
        not _torch_compat.dispatches_to_python(tensor)
        and tensor.layout is _STRIDED
        and tensor.is_contiguous()
        and not tensor.data_ptr() % ALIGNMENT
        and not tensor.is_neg()
        and not (flags & _COMPLEX and tensor.is_conj())
        and not (flags & _WIDE and not _runtime.x64_enabled())
    )


def _import_one(
    tensor: Any,
    allow_x64_downcast: bool,
    name_of: Callable[[int], str],
    index: int,
    cuda_ready: dict[int, tuple[Any, int | None]],
    cpu: Any = None,
) -> jax.Array:
    device_type = _check_supported(tensor, name_of, index)
    dtype = tensor.dtype
    target = dtype
    if _FLAGS[dtype] & _WIDE and not _runtime.x64_enabled():
        narrow = _dtypes.narrowed(dtype)
        if narrow is not None:
            low, high = _dtypes.extremes(tensor).tolist()
            _dtypes.check_narrowable(name_of(index), dtype, low, high)
        elif allow_x64_downcast:
            narrow = _dtypes.DTYPES[dtype].narrow
            assert narrow is not None  # every 64-bit dtype has a 32-bit counterpart
        else:
            raise _dtypes.x64_error(name_of(index), dtype, downcast_option="allow_x64_downcast")
        target = narrow
    copied = (
        target != dtype
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.data_ptr() % ALIGNMENT != 0
        or not is_compact(tensor.shape, tensor.stride())
    )
    if not copied and not tensor.is_contiguous() and not _permuted_layouts_ok(tensor.device):
        copied = True
    if copied:
        tensor = _fresh_copy(tensor, target)
    return _wrap(tensor, device_type, copied, cuda_ready, cpu)


#: Per torch device type: whether JAX reads permuted-dense (e.g. transposed) DLPack tensors
#: correctly, found by `_probe_permuted_layouts` on first need.
_PERMUTED_OK: dict[str, bool] = _caches.register("dlpack permuted layouts", {})


def _permuted_layouts_ok(device: torch.device) -> bool:
    verdict = _PERMUTED_OK.get(device.type)
    if verdict is None:
        verdict = _PERMUTED_OK[device.type] = _probe_permuted_layouts(device)
    return verdict


def _probe_permuted_layouts(device: torch.device) -> bool:
    """Whether a transposed tensor shared with JAX on `device` reads back correctly.

    jaxlib 0.10.2's CPU backend keeps the permutation as the array's layout; a backend may also
    refuse such a tensor or, as jaxlib 0.7 did, ignore the permutation (silently wrong values).
    Where it is not read back correctly, permuted tensors are copied to row-major instead.
    """
    expected = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
    try:
        array = _wrap(expected.t(), device.type, True, {})
        return bool(np.array_equal(np.asarray(array), expected.t().cpu().numpy()))
    except Exception:
        return False


def _wrap(
    tensor: torch.Tensor,
    device_type: str,
    after_copy: bool,
    cuda_ready: dict[int, tuple[Any, int | None]],
    cpu: Any = None,
) -> jax.Array:
    """Shares a compact, aligned tensor of a supported dtype with JAX (a CPU one on the JAX CPU
    device `cpu`; None: device 0)."""
    if device_type == "cpu":
        device = _runtime.jax_device("cpu", 0) if cpu is None else cpu
        stream, dl_device_type = None, _runtime.DL_CPU
    else:
        cuda_index = tensor.device.index
        ready = cuda_ready.get(cuda_index)
        if ready is None or after_copy:
            ready = _cuda_ready(cuda_index, cuda_ready)
        (device, stream), dl_device_type = ready, _runtime.DL_CUDA
    return _runtime.capsule_to_array(
        _runtime.tensor_to_capsule(_owed.handle(tensor)), device, stream, dl_device_type
    )


def _cuda_ready(
    cuda_index: int, cuda_ready: dict[int, tuple[Any, int | None]]
) -> tuple[Any, int | None]:
    """Orders JAX's reads on GPU `cuda_index` after all torch work queued there so far.

    Returns (and records in `cuda_ready`) the JAX device and the stream to hand to it.
    """
    device = _runtime.jax_device("cuda", cuda_index)
    stream = _runtime.jax_stream_for_imports(device)
    _runtime.make_jax_stream_wait(cuda_index, stream)
    ready = cuda_ready[cuda_index] = (device, stream)
    return ready


def _check_supported(tensor: Any, name_of: Callable[[int], str], index: int) -> str:
    """Returns the tensor's device type, or raises a TypeError saying what to do instead."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{name_of(index)}: expected a torch.Tensor, got {type(tensor).__module__}."
            f"{type(tensor).__qualname__}. Fix: pass tensors only (to_jax passes other leaves "
            f"through unchanged)."
        )
    device_type = tensor.device.type
    problem, fix = None, None
    if device_type == "xla":
        problem = "a torch-xla tensor"
        fix = (
            "call bridge_mr through its torch frontend, which embeds the JAX program in the "
            "torch-xla graph, or move the tensor with .cpu()"
        )
    elif device_type == "meta":
        problem, fix = "a meta tensor (no data)", "materialise it, e.g. with torch.empty_like"
    elif _torch_compat.dispatches_to_python(tensor):
        problem = f"a {type(tensor).__qualname__}, a tensor subclass with __torch_dispatch__"
        fix = "pass the plain tensors it holds (its memory is not its values)"
    elif tensor.is_nested:
        problem, fix = "a nested tensor", "convert it with .to_padded_tensor(0) or .unbind()"
    elif tensor.layout is not _STRIDED:
        problem, fix = f"a tensor with layout {tensor.layout}", "convert it with .to_dense()"
    elif tensor.is_quantized:
        problem, fix = f"a quantized {tensor.dtype} tensor", "convert it with .dequantize()"
    elif tensor.dtype not in _FLAGS:
        raise _dtypes.unsupported_error(name_of(index), tensor.dtype)
    elif device_type not in ("cpu", "cuda"):
        problem, fix = f"a tensor on {tensor.device}", "move it with .cpu()"
    if problem is not None:
        raise TypeError(f"{name_of(index)}: expected {_EXPECTED}, got {problem}. Fix: {fix}.")
    return device_type


def is_compact(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the strides describe a dense buffer in some dimension order (size-1 dims aside)."""
    if 0 in shape:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _fresh_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous, freshly allocated (hence aligned) copy, conjugate/negative bits resolved."""
    with torch.no_grad():
        out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        out.copy_(tensor)
    if ACTIVE:
        record(copies=1, bytes_copied=out.numel() * out.element_size())
    return out
