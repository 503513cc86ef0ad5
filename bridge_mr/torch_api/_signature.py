"""A call's signature: its flattened arguments split into tensors and static values (whose keys
`_keys` builds, see `_static`), what the statics tell (a layout, a mesh), and the errors about
them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import numpy as np
import torch
from jax.sharding import Mesh

from bridge_mr import distributed, jax_core
from bridge_mr._compat import torch as torch_compat
from bridge_mr.dlpack import host_device, host_program_device

_DEVICE_TYPES = ("cpu", "cuda", "xla", "tpu")


class _TensorSlot:
    """Marks where a tensor sat among a call's leaves (the rest are static values)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"


#: The marker standing for a tensor among a call's static leaves.
TENSOR = _TensorSlot()


@dataclasses.dataclass(frozen=True)
class ArraySlot:
    """Marks where a JAX array sat among a call's leaves: an input that is already where the
    program runs (data on the chip, say), passed to it as it is and not differentiated."""

    shape: tuple[int, ...]
    dtype: Any  # A numpy dtype, or JAX's extended one (typed PRNG keys).
    weak_type: bool


def is_array(leaf: Any) -> bool:
    """Whether `leaf` is a concrete JAX array (an input of its own, `ArraySlot`)."""
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def array_key(leaf: jax.Array) -> tuple[Any, ...]:
    """What a call's key holds of a JAX array input: its type, shape, dtype, weak type (a
    weakly typed scalar takes the other operand's dtype) and sharding."""
    # getattr: typed PRNG key arrays have no weak type (never weak).
    return (jax.Array, leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False), leaf.sharding)


def statics(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """A call's leaves with each tensor replaced by `TENSOR`, each JAX array by its
    `ArraySlot`."""
    return tuple(
        TENSOR
        if isinstance(leaf, torch.Tensor)
        else ArraySlot(tuple(leaf.shape), leaf.dtype, getattr(leaf, "weak_type", False))
        if is_array(leaf)
        else leaf
        for leaf in leaves
    )


def layout_of(static_leaves: Sequence[Any]) -> distributed.Layout | None:
    """The cross-process layout a call runs with (a `Layout` argument), or None."""
    for leaf in static_leaves:
        if isinstance(leaf, distributed.Layout):
            return leaf
    return None


def mesh_of(static_leaves: Sequence[Any]) -> Mesh | None:
    """The multi-device mesh a call runs on: a Mesh argument, else the ambient concrete mesh."""
    for leaf in static_leaves:
        if isinstance(leaf, Mesh) and leaf.size > 1:
            return leaf
    mesh = jax_core.ambient_mesh()
    return mesh if isinstance(mesh, Mesh) and mesh.size > 1 else None


def leaf_paths(treedef: Any, arg_names: Sequence[str]) -> list[str]:
    """Readable paths ("server['w']", "args[3]") of the leaves of a flattened (args, kwargs)."""
    marker = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
    paths = [""] * treedef.num_leaves
    for path, index in jax.tree_util.tree_flatten_with_path(marker)[0]:
        kind, arg, *rest = path
        if kind.idx == 1:
            head = str(arg.key)
        else:
            # jaxlib's key entries are untyped; an int index picks Sequence's item overload.
            position: int = arg.idx
            head = arg_names[position] if position < len(arg_names) else f"args[{position}]"
        paths[index] = head + jax.tree_util.keystr(tuple(rest))
    return paths


def check_tensor(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raises for a tensor no runner can pass to JAX, naming it by `where`."""
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{name}: {where} is a {str(tensor.layout).removeprefix('torch.')} tensor of "
            f"shape {tuple(tensor.shape)}; JAX takes dense (strided) tensors only. Convert it "
            "with .to_dense() first, or pass its parts (indices and values) as dense tensors."
        )
    if torch_compat.dispatches_to_python(tensor):
        raise TypeError(
            f"{name}: {where} is a {type(tensor).__qualname__}, a tensor subclass with "
            "__torch_dispatch__: its ops run Python code and its memory need not hold its "
            "values, so JAX cannot read it. Pass the plain tensors it holds instead."
        )
    kind = tensor.device.type
    if kind == "meta":
        raise TypeError(
            f"{name}: {where} is a meta tensor of shape {tuple(tensor.shape)}: it has no "
            "data to compute with. Materialise it first, e.g. torch.empty_like(t, "
            "device='cpu'), or model.to_empty(device='cpu') and initialise the parameters."
        )
    if kind not in _DEVICE_TYPES:
        raise TypeError(
            f"{name}: {where} is on device {tensor.device}; bridge_mr runs JAX on CPU, CUDA, "
            "torch-xla and TorchTPU ('tpu') tensors. Move it with .to('cpu') (or to one of "
            "those devices) first."
        )


def complex_grad_error(name: str, where: str) -> TypeError:
    """The error for a complex tensor that requires grad."""
    return TypeError(
        f"{name}: {where} is a complex tensor that requires grad; JAX and torch use different "
        "conventions for complex gradients, so bridge_mr does not differentiate them. Pass "
        "real and imaginary parts as two real tensors."
    )


def flatten_error(
    name: str, arg_names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Exception:
    """The error for arguments JAX cannot flatten: a dict whose keys do not sort."""
    names = list(arg_names) + [f"args[{i}]" for i in range(len(arg_names), len(args))]
    roots = [*zip(names, args, strict=False), *((str(k), v) for k, v in kwargs.items())]
    for root, tree in roots:
        found = _unsortable_dict(tree, root)
        if found is not None:
            path, keys = found
            listing = ", ".join(f"{k!r} ({type(k).__name__})" for k in keys[:6])
            return TypeError(
                f"{name}: {path} is a dict whose keys are of mixed types ({listing}); JAX "
                "sorts dict keys to flatten a pytree, and these do not sort. Use keys of one "
                "type, e.g. str: {str(k): v for k, v in d.items()}."
            )
    return TypeError(
        f"{name}: the arguments are not a pytree JAX can flatten; see the error above."
    )


def _unsortable_dict(tree: Any, path: str) -> tuple[str, list[Any]] | None:
    """The path and keys of the first dict in `tree` whose keys do not sort, if any."""
    if isinstance(tree, dict):
        try:
            sorted(tree)
        except TypeError:
            return path, list(tree)
        children: Any = ((f"{path}[{k!r}]", v) for k, v in tree.items())
    elif isinstance(tree, (list, tuple)):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(tree))
    else:
        return None
    for child_path, child in children:
        found = _unsortable_dict(child, child_path)
        if found is not None:
            return found
    return None


def device_error(name: str, tensors: Sequence[torch.Tensor], where: Sequence[str]) -> Exception:
    """The error for one call's tensors on several devices."""
    by_device: dict[torch.device, list[str]] = {}
    for tensor, w in zip(tensors, where, strict=True):
        by_device.setdefault(tensor.device, []).append(w)
    listing = "; ".join(f"{device}: {', '.join(ws[:3])}" for device, ws in by_device.items())
    return ValueError(
        f"{name} got tensors on different devices in one call ({listing}). One call runs "
        "on one device: move them with .to(device) first."
    )


def static_error(
    name: str, arg_names: Sequence[str], treedef: Any, static_leaves: Sequence[Any]
) -> Exception:
    """The error for a call whose static leaves cannot be keyed (unhashable, tracers)."""
    paths = leaf_paths(treedef, arg_names)
    for path, leaf in zip(paths, static_leaves, strict=True):
        if isinstance(leaf, jax.Array):  # A tracer: concrete arrays are inputs (`ArraySlot`).
            return TypeError(
                f"{name} got a JAX tracer at {path} (of shape {leaf.shape}): it was called "
                "inside a JAX transformation (jax.jit, jax.grad, jax.vmap, ...), which cannot "
                "trace a torch function. Call the JAX function itself there."
            )
        if isinstance(leaf, np.ndarray):
            return TypeError(
                f"{name} got a numpy array at {path}; pass it as a torch tensor "
                "(torch.from_numpy(x)) so it becomes a traced input."
            )
        try:
            hash(leaf)
        except TypeError:
            return TypeError(
                f"{name}: {path} is a {type(leaf).__name__}, which is neither a torch tensor "
                "nor hashable. Non-tensor arguments are static (part of the compile key) and "
                "must be hashable; pass a tensor, or a hashable value such as a tuple."
            )
    return TypeError(f"{name}: the call's static arguments are not hashable.")


def arrays_error(name: str, arg_names: Sequence[str], treedef: Any, leaves: Sequence[Any],
                 problem: str, fix: str, index: int | None = None) -> TypeError:  # fmt: skip
    """The error for a call's JAX array inputs that cannot run (`problem`, `fix`), naming the
    leaf at `index` (default: the first JAX array)."""
    paths = leaf_paths(treedef, arg_names)
    if index is None:
        index = next(i for i, leaf in enumerate(leaves) if is_array(leaf))
    path, leaf = paths[index], leaves[index]
    return TypeError(
        f"{name} got a jax.Array at {path} (shape {tuple(leaf.shape)}, {leaf.dtype}, on "
        f"{', '.join(str(d) for d in leaf.devices())}): {problem} {fix}"
    )


def program_device(device_type: str, mesh: Any, layout: Any) -> Any:
    """Where a program of CPU tensors runs when that is an accelerator (JAX's default device:
    `dlpack.host_program_device`); None where it runs where its tensors are, or over `mesh`'s
    devices or every process's (`layout`)."""
    if device_type != "cpu" or mesh is not None or layout is not None:
        return None
    return host_program_device()


def check_arrays(name: str, arg_names: Sequence[str], treedef: Any, leaves: Sequence[Any],
                 device_type: str, mesh: Any, layout: Any, on: Any) -> None:  # fmt: skip
    """Raises unless a call's JAX array inputs can go to its program as they are: CPU tensors
    on one process, no mesh, every array on the device the program runs on (`on`, the program
    device, or None: the CPU)."""
    device = on if on is not None else host_device()
    if device_type != "cpu" or mesh is not None or layout is not None:
        where = (
            f"{device_type} tensors" if device_type != "cpu"
            else "a mesh" if mesh is not None else "several processes"
        )  # fmt: skip
        problem = (
            "JAX array inputs run with CPU tensors whose program runs on one device (the CPU "
            f"or JAX's default accelerator), not with {where}."
        )
        fix = (
            "Pass this input as a torch tensor on the call's device (on CUDA it crosses "
            "without a copy), or convert it with bridge_mr.dlpack.to_torch."
        )
        raise arrays_error(name, arg_names, treedef, leaves, problem, fix)
    for index, leaf in enumerate(leaves):
        if is_array(leaf) and leaf.devices() != {device}:
            problem = (
                f"this call's program runs on {device}, and a JAX array input must already be "
                "there (it is passed to the program as it is, never moved)."
            )
            fix = f"Put it there once: jax.device_put(x, {device!r})."
            raise arrays_error(name, arg_names, treedef, leaves, problem, fix, index)
