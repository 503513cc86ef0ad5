"""Runs JAX functions on torch-xla tensors inside torch-xla's lazy graph (the TPU path).

A JAX function is lowered once per input signature to an HLO module and embedded in the
torch-xla graph as a user computation, the same mechanism as
`torch_xla.core.xla_builder.call_jax`, so the JAX computation compiles together with the
surrounding torch ops: no DLPack, no host round trip. Importing this module imports neither
torch_xla nor JAX backends; torch_xla is imported on the first call, when XLA tensors exist, and
its runtime is started (it owns the TPU) before JAX lowers anything.

SPMD: shardings in the JAX program must use Auto mesh axes (`with_sharding_constraint`, which
bridge_mr's placement primitives add for a mesh with the placement axis); torch-xla partitions
them with GSPMD. Explicit axes are refused. Under `torch_xla.runtime.use_spmd()` with a global
mesh (`torch_xla.distributed.spmd.set_global_mesh`) that has axis names, and no JAX mesh set by
the caller, the program is lowered under the Auto `AbstractMesh` of the same shape and names
(`lowering_mesh`), so a mesh axis named like the placement shards it.

64-bit integers while `jax_enable_x64` is off: the program takes int32 / uint32 where the
tensor is int64 / uint64 (`bridge_mr._dtypes.narrowed`), so such a tensor is cast in the lazy
graph (`.to(torch.int32)`) after a check that its values fit. The check reads a min and max back
from the device: one sync per call for all such tensors together, which also runs the pending
graph that computes them. Cast labels and ids to int32 yourself (or enable x64) to avoid it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core
import torch
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge_mr import _caches, jax_core
from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torch_xla as torch_xla_compat
from bridge_mr._dtypes import Aval
from bridge_mr.dlpack import tensor_avals

from ._narrowing import narrow, narrowable, positional
from ._protocols import Jitted

# jax_fn -> {(input signature, JAX's trace context, the caller's JAX mesh, the lowering mesh):
# embedded computation}. Weak in jax_fn so that functions (and what they close over) can be freed.
_EMBEDDED: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[Any, ...], Callable[..., Any]]]
_EMBEDDED = _caches.register("torch-xla embedded computations", weakref.WeakKeyDictionary())

_Embedded = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on a torch-xla device. Never imports torch_xla."""
    return tensor.device.type == "xla"


class XlaRunner:
    """Embeds a program in torch-xla's lazy graph; carried values are XLA tensors.

    The program is lowered once, at construction, under `trace_context()` (the context it was
    traced in, so JAX's trace cache serves the lowering: the JAX function is traced once).

    An int64 / uint64 tensor given for an int32 / uint32 input (x64 off) is cast in the graph
    after its values are checked, which costs one device sync per call (see the module
    docstring); int32 tensors avoid it.

    Args:
      jitted: the jitted program, traced under `trace_context()`.
      in_avals: shapes and dtypes of its inputs (tensors, then carried values).
      n_exported: how many leading outputs are returned as exported; the rest are carried.
      names: what the errors of the int32 / uint32 range check above call each tensor input
        (see `runner_for`); default `tensors[i]`.
    """

    def __init__(
        self,
        jitted: Jitted,
        in_avals: Sequence[Aval],
        n_exported: int,
        names: Sequence[str] | None = None,
    ) -> None:
        self._embedded = _embed(jitted, list(in_avals), check_flat=False)
        self._n_exported = n_exported
        self._narrowable = narrowable(in_avals)
        self._names = names

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        inputs = narrow([*tensors, *carried], self._narrowable, self._names)
        outputs = list(self._embedded(inputs))
        n = self._n_exported
        return outputs[:n], outputs[n:]


def call_jax_on_xla(
    jax_fn: Callable[..., Sequence[jax.Array]], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Applies `jax_fn` to XLA tensors as part of torch-xla's lazy graph.

    Args:
      jax_fn: a pure, `jax.jit`-traceable function taking one array per tensor (positionally)
        and returning a flat tuple or list of arrays. The cache is keyed on this object: pass
        the same object on every call (a module-level function, or one built once and kept) so
        that a signature is lowered once and torch-xla compiles its graph once.
      tensors: at least one tensor, all on the XLA device.

    Returns:
      One lazy XLA tensor per output of `jax_fn`. Nothing is executed until torch-xla syncs
      (`torch_xla.sync()`, `.cpu()`, `.item()`, ...). The outputs never require grad: autograd
      belongs to the caller (`bridge_mr.torch_function` differentiates).

    The first call for a signature traces and lowers `jax_fn` under `trace_context()`. Its
    shardings must use Auto mesh axes; under SPMD their meshes must span all of torch-xla's
    devices. Without SPMD they are ignored, with a warning.

    Raises:
      ImportError: torch_xla is not installed.
      ValueError: `tensors` is empty or holds a non-XLA tensor; the program shards over a mesh
        with Explicit axes, or (under SPMD) over a mesh of another size than the device count.
        While `jax_enable_x64` is off: an int64 / uint64 tensor holds a value outside int32 /
        uint32 (such tensors are cast to it in the graph, after a check that costs one device
        sync per call: pass int32 tensors to avoid it).
      TypeError: a float64 / complex128 tensor while `jax_enable_x64` is off; `jax_fn` does not
        return a flat tuple or list of arrays, or cannot be weakly referenced.

    Example:
      >>> x = torch.ones(3, device=torch_xla.device())
      >>> (y,) = call_jax_on_xla(lambda a: (jnp.sin(a),), [x])
    """
    tensors = list(tensors)
    _check_tensors(tensors)
    avals = list(tensor_avals(tensors, [positional(i) for i in range(len(tensors))]))
    key = (
        tuple(avals),
        jax_compat.trace_context(),
        jax_core.ambient_mesh(),
        lowering_mesh(),
    )
    try:
        per_fn = _EMBEDDED.setdefault(jax_fn, {})
    except TypeError as error:
        raise TypeError(
            f"call_jax_on_xla caches on `jax_fn`, which must be hashable and weakly referenceable; "
            f"got {type(jax_fn).__name__}. Wrap it in a function defined once: "
            f"`def fn(*arrays): return obj(*arrays)`."
        ) from error
    embedded = per_fn.get(key)
    if embedded is None:
        embedded = per_fn[key] = _embed(jax_fn, avals, check_flat=True)
    tensors = narrow(tensors, narrowable(avals), None)
    return list(embedded(tensors))


def clear_cache() -> None:
    """Drops every computation `call_jax_on_xla` embedded (runners hold their own)."""
    _EMBEDDED.clear()


def lowering_mesh() -> AbstractMesh | None:
    """The abstract mesh XLA programs are traced and lowered under now, or None for no change.

    torch-xla's global SPMD mesh (see `torch_xla_global_mesh`), unless the caller set a JAX
    mesh (`jax.set_mesh`, `jax.sharding.use_abstract_mesh`, `with mesh:`), which then applies
    as it is.
    """
    return None if jax_core.ambient_mesh() is not None else torch_xla_global_mesh()


@contextlib.contextmanager
def trace_context() -> Iterator[None]:
    """The JAX context XLA programs are traced and lowered in.

    torch-xla's runtime is started first (it must own the TPU before JAX starts a backend).
    Inside: `lowering_mesh()` as the abstract mesh, GSPMD rather than Shardy partitioning
    (torch-xla 2.9 reads GSPMD shardings from the HLO, as its own call_jax does; a thread-local
    JAX config context, so the user's JAX code elsewhere is unaffected), and torch-xla's
    environment guard against JAX's MegaScale client hanging beside it.
    """
    torch_xla = torch_xla_compat.import_torch_xla()
    torch_xla.workarounds.jax_import_guard()
    mesh = lowering_mesh()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_xla.workarounds.jax_env_context())
        stack.enter_context(jax_compat.shardy_partitioner(False))
        if mesh is not None:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
        yield


# The last torch-xla mesh converted by torch_xla_global_mesh, and its conversion.
_DERIVED: tuple[Any, AbstractMesh | None] = (None, None)


def _forget_derived() -> None:
    global _DERIVED
    _DERIVED = (None, None)


_caches.register_clear("torch-xla global mesh", _forget_derived)


def torch_xla_global_mesh() -> AbstractMesh | None:
    """The Auto `AbstractMesh` of torch-xla's global SPMD mesh, or None.

    None unless SPMD is on (`torch_xla.runtime.use_spmd()`) and a global mesh with axis names is
    set (`torch_xla.distributed.spmd.set_global_mesh`). The abstract mesh has the same shape and
    axis names, all Auto; it numbers devices 0..n-1 in order, whatever the torch-xla mesh's
    `device_ids` order.

    Raises:
      ImportError: torch_xla is not installed.
    """
    global _DERIVED
    torch_xla = torch_xla_compat.import_torch_xla()
    if not torch_xla.runtime.is_spmd():
        return None
    xla_mesh = torch_xla.spmd.get_global_mesh()
    if xla_mesh is None or xla_mesh.axis_names is None:
        return None
    if _DERIVED[0] is not xla_mesh:
        shape = tuple(int(size) for size in xla_mesh.mesh_shape)
        derived = AbstractMesh(
            shape, tuple(xla_mesh.axis_names), axis_types=(AxisType.Auto,) * len(shape)
        )
        _DERIVED = (xla_mesh, derived)
    return _DERIVED[1]


def _check_tensors(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError(
            "call_jax_on_xla needs at least one XLA tensor in `tensors` (it decides the device); "
            "got none."
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"tensors[{index}] must be a torch.Tensor; got {type(tensor).__name__}."
            )
        if not is_xla_tensor(tensor):
            torch_xla_compat.import_torch_xla()  # A missing torch_xla is the more useful error.
            raise ValueError(
                f"tensors[{index}] is on device {tensor.device}, but call_jax_on_xla runs inside "
                f"the torch-xla graph and needs every tensor on the XLA device; move it with "
                f"`tensor.to(torch_xla.device())`."
            )


def _embed(jax_fn: Callable[..., Any], avals: list[Aval], *, check_flat: bool) -> _Embedded:
    """Traces and lowers `jax_fn` for `avals` under `trace_context()`; torch-xla's callable."""
    torch_xla = torch_xla_compat.import_torch_xla()
    with trace_context():
        traced = jax.jit(jax_fn, keep_unused=True).trace(
            *(jax.ShapeDtypeStruct(*aval) for aval in avals)
        )
        _check_shardings(traced.jaxpr.jaxpr, torch_xla.runtime)
        lowered = traced.lower()
        hlo_module = lowered.compiler_ir("hlo")
        assert hlo_module is not None  # jit's XLA lowering always has an HLO form
        hlo = hlo_module.as_serialized_hlo_module_proto()
    if check_flat:
        leaves = jax.tree.leaves(lowered.out_info)
        if lowered.out_tree not in (jax.tree.structure(tuple(leaves)), jax.tree.structure(leaves)):
            raise TypeError(
                f"jax_fn must return a flat tuple or list of arrays (`return (y,)` for one "
                f"output); it returned the structure {lowered.out_tree}."
            )
    name = "bridge_mr_" + re.sub(r"\W", "_", getattr(jax_fn, "__name__", "jax_fn"))
    computation = torch_xla.builder.computation_from_module_proto(name, hlo)
    return torch_xla.builder.xla_computation_as_func(computation, name)


def _shardings(jaxpr: jax.extend.core.Jaxpr) -> Iterator[NamedSharding]:
    """Every named sharding in `jaxpr` and its sub-jaxprs: of values and in parameters."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            sharding = getattr(var.aval, "sharding", None)
            if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
                yield sharding
        for param in eqn.params.values():
            for value in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(value, NamedSharding):
                    yield value
                elif isinstance(value, jax.extend.core.ClosedJaxpr):
                    yield from _shardings(value.jaxpr)
                elif isinstance(value, jax.extend.core.Jaxpr):
                    yield from _shardings(value)


def _splits(sharding: NamedSharding) -> bool:
    """Whether `sharding` splits some dimension over a mesh axis."""
    return any(entry not in (None, P.UNCONSTRAINED) for entry in sharding.spec)


def _describe(mesh: Mesh | AbstractMesh) -> str:
    return ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())


def _auto_mesh_code(shape: tuple[int, ...], names: Sequence[str]) -> str:
    """Python source of an all-Auto `AbstractMesh`, for error messages."""
    types = ", ".join(["jax.sharding.AxisType.Auto"] * len(names))
    return f"jax.sharding.AbstractMesh({shape}, {tuple(names)}, axis_types=({types},))"


def _check_shardings(jaxpr: jax.extend.core.Jaxpr, runtime: Any) -> None:
    """Raises for shardings torch-xla cannot run; warns when SPMD is off and they do nothing."""
    split_meshes = {}
    for sharding in _shardings(jaxpr):
        mesh = sharding.mesh
        if AxisType.Explicit in mesh.axis_types:
            names = tuple(
                name
                for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if kind == AxisType.Explicit
            )
            raise ValueError(
                f"bridge_mr on torch-xla: the JAX program uses a mesh with Explicit axes {names} "
                f"({{{_describe(mesh)}}}); torch-xla partitions with GSPMD, which takes Auto axes "
                f"only. Pass mesh={_auto_mesh_code(tuple(mesh.axis_sizes), mesh.axis_names)}, or "
                "set no mesh and let bridge_mr use torch-xla's global SPMD mesh "
                "(torch_xla.distributed.spmd.set_global_mesh)."
            )
        if _splits(sharding):
            split_meshes[mesh.shape_tuple] = mesh
    if not split_meshes:
        return
    if not runtime.is_spmd():
        described = "; ".join(f"{{{_describe(mesh)}}}" for mesh in split_meshes.values())
        warnings.warn(
            f"bridge_mr on torch-xla: the JAX program shards values over a mesh {described}, "
            "but torch-xla's SPMD mode is off, so it runs unsharded on one device (same results). "
            "To shard, call torch_xla.runtime.use_spmd() first thing in the program, before any "
            "XLA tensor exists (called later, torch-xla replicates the existing tensors).",
            UserWarning,
            stacklevel=2,
        )
        return
    devices = runtime.global_runtime_device_count()
    for mesh in split_meshes.values():
        if mesh.size != devices:
            raise ValueError(
                f"bridge_mr on torch-xla: the JAX program shards over a mesh of {mesh.size} "
                f"devices ({{{_describe(mesh)}}}), but torch-xla's SPMD runtime has {devices}; "
                f"its GSPMD partitioner needs a mesh over all {devices} devices. Give a mesh "
                f"whose axis sizes multiply to {devices}, e.g. "
                f"{_auto_mesh_code((devices,), mesh.axis_names[:1])}."
            )
