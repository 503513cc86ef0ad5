"""A traced call: one signature of a torch function, traced once, and what its trace found.

`trace(spec, counter)` traces the JAX function for one call signature (`CallSpec`) and returns
an immutable `TracedCall`. What only the trace can tell (the output tree, shapes and dtypes,
whether forward also computed the gradients, the structure of the VJP residuals) comes back
from the trace itself, as a static output of the traced function (`Outputs`), read from
`jax.jit(...).trace(...).out_info`: nothing is stored by mutation, so two threads tracing one
function under two contexts cannot overwrite each other's facts.

The programs derived from a traced call -- the VJP over its residuals (`residual_vjp`), the
VJP and JVP from the primal inputs (`vjp_from_inputs`, `jvp_from_inputs`) -- are functions of
the `TracedCall`'s values.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge_mr import distributed, jax_core, runners
from bridge_mr._dtypes import Aval, is_differentiable, torch_dtype
from bridge_mr.typing import PyTree

from ._keys import matmul_precision
from ._signature import TENSOR, ArraySlot

F = TypeVar("F", bound=Callable[..., Any])


class TraceCounter:
    """Counts the JAX traces of one torch function and of the programs derived from it."""

    __slots__ = ("_count", "_lock")

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        """The traces so far."""
        return self._count


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """Everything about one call signature known before tracing.

    `statics` are the call's flattened leaves with `TENSOR` where a tensor sat; `diff` the
    indices (among the tensors) of those that need gradients. Across processes, `layout` is
    the agreed layout of the ranks' clients, `in_avals` are global shapes, and `per_rank` says
    which tensors hold this rank's clients (one flag per tensor). `program_device` is the JAX
    device the program of CPU tensors runs on where that is an accelerator
    (`dlpack.host_program_device()`), else None (where the tensors are). The statics'
    `ArraySlot`s are JAX array inputs, which programs take after the tensors, undifferentiated.
    """

    fn: Callable[..., PyTree]
    name: str
    treedef: Any
    statics: tuple[Any, ...]
    in_avals: tuple[Aval, ...]
    diff: tuple[int, ...]
    device_type: str
    mesh: Mesh | None
    layout: distributed.Layout | None = None
    per_rank: tuple[bool, ...] = ()
    program_device: Any = None

    @functools.cached_property
    def tensor_positions(self) -> tuple[int, ...]:
        """Where among the leaves the tensors sit."""
        return tuple(i for i, s in enumerate(self.statics) if s is TENSOR)

    @functools.cached_property
    def array_positions(self) -> tuple[int, ...]:
        """Where among the leaves the JAX array inputs sit."""
        return tuple(i for i, s in enumerate(self.statics) if isinstance(s, ArraySlot))


_NO_TREE = jax.tree_util.tree_structure(None)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a trace found about its outputs (a static output of the traced function).

    `tree`, `avals`: the JAX function's output structure and leaf shapes and dtypes. `fused`:
    forward also returned the gradients (the output is one float scalar, whose VJP is linear
    in its one cotangent). `residual_tree`, `residual_avals`: the flattened `jax.vjp` closure
    forward returned after the outputs (the tree of None and () when fused or without
    gradients: a PyTreeDef, since PyTreeDefs do not compare with other types).
    """

    tree: Any
    avals: tuple[Aval, ...]
    fused: bool = False
    residual_tree: Any = _NO_TREE
    residual_avals: tuple[Aval, ...] = ()

    @functools.cached_property
    def n_out(self) -> int:
        """How many output leaves."""
        return len(self.avals)

    @functools.cached_property
    def is_leaf(self) -> bool:
        """Whether the JAX function returned one array rather than a tree."""
        return self.n_out == 1 and jax.tree_util.treedef_is_leaf(self.tree)

    @functools.cached_property
    def float_outputs(self) -> tuple[int, ...]:
        """The outputs torch differentiates (real floating)."""
        return tuple(i for i, (_, dtype) in enumerate(self.avals) if is_differentiable(dtype))

    @functools.cached_property
    def non_diff_outputs(self) -> tuple[int, ...]:
        """The outputs torch marks non-differentiable."""
        floats = frozenset(self.float_outputs)
        return tuple(i for i in range(self.n_out) if i not in floats)


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """One call signature, traced: its forward program and what the trace found.

    `forward` takes the tensors (as arrays) and returns the output leaves, then the gradients
    (fused) or the VJP residuals; `extra_avals` describe those after the outputs. `counter`
    counts the traces of the programs derived from it too.
    """

    spec: CallSpec
    forward: runners.Jitted
    outputs: Outputs
    counter: TraceCounter
    #: The XLA options the runners compile forward and the VJP over its residuals with (on CPU:
    #: YNNPACK's fusions chosen from the program, `jax_core.cpu_compiler_options`).
    compiler_options: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    #: Over a mesh: the types (shapes, dtypes, shardings) of what forward computes for backward,
    #: as the runner carries them to the VJP (residuals sharded along an Explicit placement axis
    #: say so); empty otherwise, where `extra_avals` tell all.
    extra_types: tuple[jax.ShapeDtypeStruct, ...] = dataclasses.field(default=(), compare=False)

    @property
    def n_exported(self) -> int:
        """How many leading outputs forward exports as tensors on the autograd path."""
        return self.outputs.n_out + (len(self.spec.diff) if self.outputs.fused else 0)

    @property
    def extra_avals(self) -> tuple[Aval, ...]:
        """Shapes and dtypes of what forward computes for backward: gradients or residuals."""
        if self.outputs.fused:
            return tuple(self.spec.in_avals[i] for i in self.spec.diff)
        return self.outputs.residual_avals

    @property
    def cotangent_avals(self) -> tuple[Aval, ...]:
        """Shapes and dtypes of the cotangents backward takes (one per float output)."""
        return tuple(self.outputs.avals[i] for i in self.outputs.float_outputs)

    @property
    def grad_avals(self) -> tuple[Aval, ...]:
        """Shapes and dtypes of the gradients backward returns (one per input in `diff`)."""
        return tuple(self.spec.in_avals[i] for i in self.spec.diff)


def trace(spec: CallSpec, counter: TraceCounter) -> TracedCall:
    """Traces `spec`'s forward program once, under its runner's context.

    Raises:
      TypeError: the JAX function used torch, or returned a non-array or a dtype torch lacks.
    """
    structured = jax.jit(_on_device(spec, functools.partial(_forward, spec, counter)))
    with runners.trace_context(spec.device_type):
        # Typed as the runner passes the tensors: the residuals' order and tree come from this
        # trace, and backward reads the residuals forward computed with them.
        traced = structured.trace(
            *_shape_structs(spec.in_avals, _tensor_sharding(spec)), *_array_structs(spec)
        )
    flat, outputs = traced.out_info
    options = jax_core.cpu_compiler_options(traced.jaxpr) if spec.device_type == "cpu" else {}
    forward = jax.jit(functools.partial(_outputs_of, structured, spec.name, outputs))
    sharding = _tensor_sharding(spec)
    extra_types = ()
    if sharding is not None:
        extra_types = tuple(_on_mesh(struct, sharding) for struct in flat[outputs.n_out :])
    return TracedCall(spec, forward, outputs, counter, options, extra_types)


def residual_vjp(call: TracedCall) -> runners.Jitted:
    """The jitted VJP over forward's residuals: (float cotangents, residuals) -> gradients."""
    jitted = jax.jit(_on_device(call.spec, functools.partial(_backward, call)))
    with runners.trace_context(call.spec.device_type):
        cotangents = _shape_structs(call.cotangent_avals, _tensor_sharding(call.spec))
        jitted.trace(*cotangents, *(call.extra_types or _shape_structs(call.extra_avals)))
    return jitted


def forward_runner(
    call: TracedCall, names: Sequence[str], *, with_extras: bool = False
) -> runners.Runner:
    """The runner of `call`'s forward program, for tensors on its device.

    Args:
      call: the traced call.
      names: what errors call each tensor input (e.g. "map_reduce: argument clients['y']").
      with_extras: export what forward computes for backward (gradients or residuals) as
        tensors too, as the custom op does; else only the outputs and fused gradients are
        exported (`TracedCall.n_exported`) and residuals stay on the runner's side.

    Returns:
      A runner `(tensors, JAX array inputs) -> (exported tensors, carried residuals)`.
    """
    spec = call.spec
    out_per_rank: tuple[bool, ...] = ()
    if spec.layout is not None:  # Gradients of per-rank inputs are per-rank.
        fused_grads = tuple(spec.per_rank[i] for i in spec.diff) if call.outputs.fused else ()
        out_per_rank = (False,) * call.outputs.n_out + fused_grads
    return runners.runner_for(
        spec.device_type,
        call.forward,
        spec.in_avals,
        call.outputs.n_out + len(call.extra_avals) if with_extras else call.n_exported,
        spec.mesh,
        compiler_options=call.compiler_options,
        names=names,
        layout=spec.layout,
        in_per_rank=spec.per_rank,
        out_per_rank=out_per_rank,
        device=spec.program_device,
    )


def residual_runner(call: TracedCall, *, residuals_as_tensors: bool = False) -> runners.Runner:
    """The runner of the VJP over `call`'s residuals (`residual_vjp`): gradients as tensors.

    Args:
      call: the traced call (not fused: its forward returned residuals).
      residuals_as_tensors: the residuals come as tensors after the cotangents (the custom
        op's); else as the values a `forward_runner` carried.

    Returns:
      A runner `(cotangents[, residuals], [residuals]) -> (gradients, [])`.
    """
    spec = call.spec
    tensor_avals, carried_avals = call.cotangent_avals, call.extra_avals
    if residuals_as_tensors:
        tensor_avals, carried_avals = (*tensor_avals, *carried_avals), ()
    layout = spec.layout
    return runners.runner_for(
        spec.device_type,
        residual_vjp(call),
        tensor_avals,
        len(spec.diff),
        spec.mesh,
        carried_avals=carried_avals,
        compiler_options=call.compiler_options,
        layout=layout,
        in_per_rank=(False,) * len(tensor_avals) if layout else (),
        out_per_rank=tuple(spec.per_rank[i] for i in spec.diff) if layout else (),
        device=spec.program_device,
    )


def vjp_from_inputs(
    call: TracedCall,
) -> Callable[[list[jax.Array], list[jax.Array], list[jax.Array]], Any]:
    """The VJP from the primal inputs: (the tensors' arrays, float cotangents, the JAX array
    inputs) -> gradients (a JAX function).

    It recomputes forward, so it is differentiable itself (higher derivatives).
    """
    return functools.partial(_vjp, call)


def jvp_from_inputs(
    call: TracedCall,
) -> Callable[[list[jax.Array], list[jax.Array], tuple[int, ...], list[jax.Array]], Any]:
    """The JVP: (the tensors' arrays, tangents of those at `positions`, positions, the JAX
    array inputs) -> float tangents."""
    return functools.partial(_jvp, call)


def cotangents(outputs: Outputs, float_cotangents: Sequence[Any]) -> list[Any]:
    """Cotangents for every output, given those of the float ones.

    Outputs torch does not differentiate get zero cotangents: of their own dtype where JAX
    differentiates them (complex), float0 where it does not (integers, bools).
    """
    given = iter(float_cotangents)
    floats = frozenset(outputs.float_outputs)
    return [
        next(given)
        if i in floats
        else np.zeros(shape, dtype if jnp.issubdtype(dtype, jnp.inexact) else jax.dtypes.float0)
        for i, (shape, dtype) in enumerate(outputs.avals)
    ]


def _on_device(spec: CallSpec, program: F) -> F:
    """`program` as compiled for `spec`'s device.

    On CPU, every convolution in the layout XLA runs fast, those of the gradients and those in
    loop bodies too, and large float sums as accurate as torch's where the program compiles
    without YNNPACK's reduce fusion (`jax_core.cpu_program`; its options:
    `jax_core.cpu_compiler_options`). On an accelerator (CUDA or TorchTPU tensors, or CPU
    tensors whose program runs on one), float32 matrix products and convolutions at torch's
    `torch.get_float32_matmul_precision()` (`matmul_precision`). torch-xla: as traced.
    """
    if spec.device_type == "cpu" and spec.program_device is None:
        return jax_core.cpu_program(program)
    if spec.device_type == "xla":
        return program
    precision = matmul_precision()

    def at_torch_precision(*args: Any) -> Any:
        with jax.default_matmul_precision(precision):
            return program(*args)

    return cast(F, at_torch_precision)


def _shape_structs(avals: Sequence[Aval], sharding: Any = None) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(*aval, sharding=sharding) for aval in avals]


def _array_structs(spec: CallSpec) -> list[jax.ShapeDtypeStruct]:
    """The types of `spec`'s JAX array inputs, weak types included (as the arrays have them)."""
    slots = [spec.statics[i] for i in spec.array_positions]
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type) for s in slots]


def _tensor_sharding(spec: CallSpec) -> NamedSharding | None:
    """How the runner passes `spec`'s tensors to its programs: replicated over a mesh, or None.

    The DLPack runner replicates tensors over `spec.mesh` (`runners.DlpackRunner`). Tracing with
    the same types matters beyond a second trace: where the placement axis is Explicit, the
    server's leaves typed on no mesh are resharded onto it (`jax_core.map_fn`) and typed on the
    mesh are not, and the VJP's residuals then come in another order.
    """
    if spec.mesh is None or spec.layout is not None or spec.device_type == "xla":
        return None
    return NamedSharding(spec.mesh, PartitionSpec())


def _on_mesh(struct: jax.ShapeDtypeStruct, tensors: NamedSharding) -> jax.ShapeDtypeStruct:
    """A traced output's type on the tensors' concrete mesh, as the array forward returns has it.

    The trace types it on the abstract mesh, or on none (then it is replicated); typed so, the
    VJP's first trace would not be the one its runner reuses.
    """
    spec = PartitionSpec() if struct.sharding is None else struct.sharding.spec
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=tensors.update(spec=spec))


def _outputs_of(
    structured: Callable[..., tuple[list[jax.Array], Outputs]],
    name: str,
    expected: Outputs,
    *arrays: Any,
) -> list[jax.Array]:
    """The flat outputs of the structured forward; checks a retrace finds what the first did.

    JAX traces again after `jax.clear_caches()`: a function that now returns another tree
    would otherwise be read with the first trace's structure.
    """
    flat, found = structured(*arrays)
    _same_outputs(name, expected, found)
    return flat


def _call_fn(spec: CallSpec, arrays: Sequence[jax.Array]) -> tuple[list[jax.Array], Outputs]:
    """The JAX function on `arrays` (in the tensors' places, then the JAX array inputs'): its
    output leaves and `Outputs`."""
    leaves = list(spec.statics)
    positions = (*spec.tensor_positions, *spec.array_positions)
    for position, array in zip(positions, arrays, strict=True):
        leaves[position] = array
    args, kwargs = jax.tree_util.tree_unflatten(spec.treedef, leaves)
    try:
        result = spec.fn(*args, **kwargs)
    except TypeError as err:
        if "Tracer" in str(err) and "Tensor" in str(err):
            raise TypeError(
                f"{spec.name}: a torch operation got a JAX value ({err}). The function runs on "
                "JAX arrays while it is traced: write it with jax.numpy (jnp.sum, jnp.tanh, "
                "...), not torch, and pass torch tensors as its arguments rather than closing "
                "over them."
            ) from err
        raise
    path_leaves, tree = jax.tree_util.tree_flatten_with_path(result)
    for path, leaf in path_leaves:
        if not isinstance(leaf, jax.Array):
            raise TypeError(
                f"{spec.name} returned a non-array leaf at output{jax.tree_util.keystr(path)}: "
                f"expected a JAX array, got {type(leaf).__name__}: {leaf!r}. Return "
                "jnp.asarray(value), or pass non-array results outside the function."
            )
    avals = tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for _, leaf in path_leaves)
    for _, dtype in avals:
        torch_dtype(dtype)  # Raises for a dtype torch does not have.
    return [leaf for _, leaf in path_leaves], Outputs(tree, avals)


def _varied(
    spec: CallSpec, arrays: Sequence[jax.Array], *varied: jax.Array
) -> tuple[list[jax.Array], Outputs]:
    """`_call_fn` with the inputs in `spec.diff` replaced by `varied`."""
    full = list(arrays)
    for i, array in zip(spec.diff, varied, strict=True):
        full[i] = array
    return _call_fn(spec, full)


def _forward(
    spec: CallSpec, counter: TraceCounter, *arrays: jax.Array
) -> tuple[list[jax.Array], Outputs]:
    counter()
    if not spec.diff:
        return _call_fn(spec, arrays)
    outs, vjp, found = jax.vjp(
        functools.partial(_varied, spec, arrays), *(arrays[i] for i in spec.diff), has_aux=True
    )
    if len(outs) == 1 and outs[0].shape == () and is_differentiable(outs[0].dtype):
        # A scalar's VJP is linear in its one cotangent: computing the gradient now and
        # scaling it in backward is exact and keeps no residuals.
        grads = vjp([jnp.ones((), outs[0].dtype)])
        return [*outs, *grads], dataclasses.replace(found, fused=True)
    residuals, residual_tree = jax.tree_util.tree_flatten(vjp)
    residual_avals = tuple((tuple(r.shape), np.dtype(r.dtype)) for r in residuals)
    return [*outs, *residuals], dataclasses.replace(
        found, residual_tree=residual_tree, residual_avals=residual_avals
    )


def _backward(call: TracedCall, *flat: jax.Array) -> list[jax.Array]:
    call.counter()
    k = len(call.outputs.float_outputs)
    vjp = jax.tree_util.tree_unflatten(call.outputs.residual_tree, flat[k:])
    return list(vjp(cotangents(call.outputs, flat[:k])))


def _same_outputs(name: str, expected: Outputs, found: Outputs) -> None:
    if (found.tree, found.avals) != (expected.tree, expected.avals):
        raise ValueError(
            f"{name}: the output tree changed between two traces of the same call "
            f"signature: first {expected.tree} with {expected.avals}, now {found.tree} with "
            f"{found.avals}. A JAX function must return the same structure, shapes and dtypes "
            "for the same inputs; do not branch on Python state that changes between calls."
        )


def _vjp(
    call: TracedCall,
    arrays: list[jax.Array],
    float_cotangents: list[jax.Array],
    resident: list[jax.Array],
) -> list[jax.Array]:
    spec = call.spec
    _, vjp, found = jax.vjp(
        functools.partial(_varied, spec, [*arrays, *resident]),
        *(arrays[i] for i in spec.diff),
        has_aux=True,
    )
    _same_outputs(call.spec.name, call.outputs, found)
    return list(vjp(cotangents(call.outputs, float_cotangents)))


def _jvp(
    call: TracedCall,
    arrays: list[jax.Array],
    tangents: list[jax.Array],
    positions: tuple[int, ...],
    resident: list[jax.Array],
) -> list[jax.Array]:
    def outputs(*varied: jax.Array) -> list[jax.Array]:
        full = [*arrays, *resident]
        for i, array in zip(positions, varied, strict=True):
            full[i] = array
        outs, found = _call_fn(call.spec, full)
        _same_outputs(call.spec.name, call.outputs, found)
        return outs

    _, out_tangents = jax.jvp(outputs, [arrays[i] for i in positions], tangents)
    return [out_tangents[i] for i in call.outputs.float_outputs]
