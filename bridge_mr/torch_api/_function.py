"""`torch_function`: a JAX function as a differentiable torch function over pytrees of tensors."""

from __future__ import annotations

import functools
import pickle
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh

from bridge_mr import _dtypes
from bridge_mr._compat import jax as _jax_compat
from bridge_mr._compat import torch as _torch_compat
from bridge_mr.jax_core import current_placement

from . import _custom_op
from ._executor import Runner, runner_for, trace_context
from ._static import FunctionIdentity, static_key

PyTree = Any


class JaxFunction(Protocol):
    """A JAX function: pytrees of arrays (and static values) in, a pytree of arrays out."""

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree: ...


class _TensorSlot:
    """Marks where a tensor sat among a call's leaves (the rest are static values)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()
_MAX_ENTRIES = 256
# Entries keyed by a function's identity (see _static): a function re-created on every call
# adds one per call, so they are bounded more tightly, oldest first.
_MAX_IDENTITY_ENTRIES = 16
# After this many traces caused by re-created functions of one code object, warn once.
_RETRACE_WARNING_AT = 3
_DEVICE_TYPES = ("cpu", "cuda", "xla")
_GRAPH_BREAK_RESUMES = _torch_compat.graph_break_resumes()

# The mesh `jax.set_mesh` activates (part of the compile key); older jax has no such context.
_ambient_mesh = getattr(jax.sharding, "get_abstract_mesh", lambda: None)


class TorchFunction:
    """A JAX function callable on pytrees of torch tensors, differentiable by torch autograd.

    Tensor leaves of the arguments become JAX arrays; every other leaf (a number, a string, a
    callable, a mesh) is static: it is part of the compile key and must be hashable, so pass a
    tensor for a value that changes from call to call. A static function (a lambda, a
    `functools.partial`) is keyed by its code, defaults and captured values, so one re-created
    on every call does not trace again. Outputs come back as torch tensors in the structure the
    JAX function returns. Each distinct signature (tree structure, static values, shapes,
    dtypes, devices, which inputs need gradients, grad mode, the active placement and mesh) is
    traced once; `trace_count` says how many JAX traces this function has done so far.

    With `passthrough_jax=True`, a call whose arguments hold no torch tensor is a plain call of
    the JAX function (JAX arrays in, JAX arrays out). `name` and `arg_names` (the names of the
    positional parameters) are what error messages call the function and its arguments.
    """

    def __init__(
        self,
        jax_fn: JaxFunction,
        *,
        compilable: bool = False,
        passthrough_jax: bool = False,
        name: str | None = None,
        arg_names: Sequence[str] = (),
    ) -> None:
        if not callable(jax_fn):
            raise TypeError(
                f"torch_function(jax_fn) expects a callable JAX function; got "
                f"{type(jax_fn).__name__}: {jax_fn!r}."
            )
        functools.update_wrapper(self, jax_fn, updated=())
        self._jax_fn = jax_fn
        self._passthrough_jax = passthrough_jax
        self._name = name
        self.arg_names = tuple(arg_names)
        self.compilable = compilable
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._identity_keys: list[tuple[Any, ...]] = []
        # Per code object: how many distinct function objects of it were traced, and the last.
        self._retraces: dict[Any, tuple[int, int]] = {}
        self._lock = threading.RLock()
        self._traces = 0
        self.uid = _custom_op.register_function(self) if self.compilable else ""

    def _state(self) -> dict[str, Any]:
        # Caches, locks and traced programs stay behind: a copy traces afresh.
        return {
            "jax_fn": self._jax_fn,
            "compilable": self.compilable,
            "passthrough_jax": self._passthrough_jax,
            "name": self._name,
            "arg_names": self.arg_names,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            pickle.dumps(self._jax_fn)
        except Exception as err:
            raise pickle.PicklingError(
                f"cannot pickle {self!r}: its JAX function {self._jax_fn!r} cannot be pickled "
                f"({type(err).__name__}: {err}). Define the JAX function at module level so "
                "pickle can find it by name, or send it with cloudpickle. (A TorchFunction "
                "pickles as its JAX function and options; its compile cache is not pickled.)"
            ) from err
        return (_rebuild, (self._state(),))

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchFunction:
        clone = _rebuild(self._state())
        memo[id(self)] = clone
        return clone

    @property
    def jax_fn(self) -> JaxFunction:
        """The wrapped JAX function."""
        return self._jax_fn

    @property
    def trace_count(self) -> int:
        """How many times JAX has traced this function or a program derived from it (its VJP)."""
        return self._traces

    def __repr__(self) -> str:
        if self._name is not None:
            return self._name
        name = getattr(self._jax_fn, "__qualname__", None) or repr(self._jax_fn)
        return f"torch_function({name})"

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        if self.compilable:
            return _custom_op.call(self, args, kwargs)
        if torch.compiler.is_compiling():
            # torch.compile cannot trace into JAX: this call runs eagerly, between two graphs.
            # The explicit break carries the reason (fullgraph=True reports it); the disabled
            # call is built here, not ahead, as building one imports torch._dynamo.
            if _GRAPH_BREAK_RESUMES:
                torch._dynamo.graph_break(
                    msg=f"bridge_mr: {self!r} runs a JAX program, which torch.compile cannot "
                    "trace, so it runs eagerly between two graphs. Under fullgraph=True, call a "
                    "JAX function made with bridge_mr.torch_function(jax_fn, compilable=True) "
                    "instead: a torch.library custom op that torch.compile traces (put the "
                    "broadcast / map_fn / reduce_* of a map_reduce inside jax_fn, under "
                    "@bridge_mr.program)."
                )
            return torch.compiler.disable(self._call)(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
        try:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        except (TypeError, ValueError) as err:
            raise _flatten_error(self, args, kwargs) from err
        grad = torch.is_grad_enabled()
        tensors: list[torch.Tensor] = []
        # A tensor's signature stands where the tensor sat; a static value's key where it did.
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
                parts.append(
                    (
                        type(leaf),
                        leaf.shape,
                        leaf.dtype,
                        leaf.device,
                        leaf.layout,
                        leaf.requires_grad,
                    )
                )
            else:
                parts.append(static_key(leaf))
        if not tensors and self._passthrough_jax:
            return self._jax_fn(*args, **kwargs)
        key = (
            treedef,
            tuple(parts),
            grad,
            current_placement(),
            _ambient_mesh(),
            _jax_compat.trace_context(),
        )
        try:
            entry = self._entries.get(key)
        except TypeError:
            raise _static_error(self, treedef, _statics(leaves), tensors) from None
        if entry is None:
            diff = tuple(i for i, t in enumerate(tensors) if grad and t.requires_grad)
            entry = self._entry(key, treedef, _statics(leaves), tensors, diff)
        if _torch_compat.functorch_transforms_active() or _torch_compat.forward_ad_active():
            # torch.func transforms and forward-mode AD (dual tensors) need the Python apply.
            outputs = _JaxCall.apply(_Call(entry, tensors, forward_mode=True), *tensors)
        elif entry.diff:
            outputs = _apply(_Call(entry, tensors), *tensors)
        else:
            outputs, _ = entry.forward(tensors, ())
        if entry.out_is_leaf:
            return outputs[0]
        return jax.tree_util.tree_unflatten(entry.out_def, outputs)

    def _entry(
        self,
        key: tuple[Any, ...],
        treedef: Any,
        statics: list[Any],
        tensors: Sequence[torch.Tensor],
        diff: tuple[int, ...],
        *,
        check_tensors: bool = True,
    ) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                identities = [k for k in key[1] if isinstance(k, FunctionIdentity)]
                if identities:
                    self._note_retrace(identities)
                entry = _Entry(self, treedef, statics, tensors, diff, check_tensors=check_tensors)
                # Compiled graphs name a compilable function's entries by uid: those stay.
                if not self.compilable:
                    if identities:
                        self._identity_keys.append(key)
                        if len(self._identity_keys) > _MAX_IDENTITY_ENTRIES:
                            self._entries.pop(self._identity_keys.pop(0), None)
                    if len(self._entries) >= _MAX_ENTRIES:
                        del self._entries[next(iter(self._entries))]
                self._entries[key] = entry
            return entry

    def _note_retrace(self, identities: list[FunctionIdentity]) -> None:
        """Warns (once per code object) when new function objects keep being traced.

        A new shape for the same function object is an ordinary trace, not counted.
        """
        for identity in identities:
            code = identity.code()
            count, last = self._retraces.get(code, (0, 0))
            if id(identity.fn) == last:
                continue
            count += 1
            self._retraces[code] = (count, id(identity.fn))
            if count == _RETRACE_WARNING_AT:
                where = (
                    f"{code.co_name} at {code.co_filename}:{code.co_firstlineno}"
                    if code is not None
                    else repr(identity.fn)
                )
                warnings.warn(
                    f"{self!r} traced {where} {count} times: it is a new function object on "
                    f"each call and reads {identity.why}, which bridge_mr cannot compare by "
                    "value, so (as jax.jit does) each new object is traced and compiled "
                    "again. To trace once, pass values that change between calls (a learning "
                    "rate, a step count) as tensors, or create the function once and pass that "
                    "same object (then changes to what it reads are not seen, as with "
                    "jax.jit).",
                    RetraceWarning,
                    stacklevel=5,
                )

    def op_entry(self, tensors: Sequence[torch.Tensor], diff: tuple[int, ...]) -> _Entry:
        """The entry for a call with these positional tensors, `diff` needing gradients."""
        treedef = jax.tree_util.tree_structure((tuple(range(len(tensors))), {}))
        signature = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        key = (treedef, signature, diff)
        entry = self._entries.get(key)
        if entry is None:
            # The dispatcher hands the op plain tensors, or fake ones to trace: none to check.
            entry = self._entry(
                key, treedef, [_TENSOR] * len(tensors), tensors, diff, check_tensors=False
            )
        return entry

    def _count_trace(self) -> None:
        with self._lock:
            self._traces += 1


class RetraceWarning(UserWarning):
    """A call traced again because its function is new each time and cannot be keyed by value."""


def _rebuild(state: dict[str, Any]) -> TorchFunction:
    return TorchFunction(**state)


def torch_function(jax_fn: JaxFunction, *, compilable: bool = False) -> TorchFunction:
    """Wraps a JAX function as a differentiable torch function over pytrees of tensors.

    The JAX function may use the placement primitives (`broadcast`, `map_fn`, `reduce_*`) under
    `program`. Forward runs one compiled program; for a function whose output is one float
    scalar (a loss), that program also computes the gradients, which backward only scales;
    otherwise it returns the VJP residuals and backward runs one compiled VJP. Under
    `torch.no_grad()`, or when no input requires grad, only the forward program runs.
    Non-tensor leaves of the arguments are static (hashable, part of the compile key).
    Under `torch.compile` such a function runs eagerly between graphs (a graph break).

    With `compilable=True` the function is a `torch.library` custom op that `torch.compile`
    traces, `fullgraph=True` included: it takes tensors as positional arguments only (bind
    static values with `functools.partial`), the JAX function returns one array or a flat
    tuple or list of arrays, and the call returns a tensor or a tuple of tensors. Its
    residuals travel as tensors; `create_graph=True` is not supported there. The JAX function
    should set its own placement (`@program(...)`): the context of the compiled caller is not
    seen when the graph runs.
    """
    return TorchFunction(jax_fn, compilable=compilable)


class _Entry:
    """One call signature of a TorchFunction: its traced programs and how to read their results."""

    def __init__(
        self,
        owner: TorchFunction,
        treedef: Any,
        statics: list[Any],
        tensors: Sequence[torch.Tensor],
        diff: tuple[int, ...],
        *,
        check_tensors: bool,
    ) -> None:
        self.owner = owner
        self.treedef = treedef
        self.statics = statics
        self.tensor_positions = tuple(i for i, s in enumerate(statics) if s is _TENSOR)
        paths = _leaf_paths(treedef, owner.arg_names)
        where = [f"argument {paths[p]}" for p in self.tensor_positions]
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise _device_error(owner, tensors, where)
        if check_tensors:
            for tensor, w in zip(tensors, where, strict=True):
                _check_tensor(owner, tensor, w)
        self.device_type = tensors[0].device.type if tensors else "cpu"
        self.in_avals = [
            (tuple(t.shape), _dtypes.jax_dtype(t.dtype, where=w, xla=t.device.type == "xla"))
            for t, w in zip(tensors, where, strict=True)
        ]
        self.diff = diff
        for i in self.diff:
            if tensors[i].dtype.is_complex:
                raise TypeError(
                    f"{owner!r}: {where[i]} is a complex tensor that requires grad; JAX and torch "
                    "use different conventions for complex gradients, so bridge_mr does not "
                    "differentiate them. Pass real and imaginary parts as two real tensors."
                )
        self.out_def: Any = None
        self.out_avals: tuple[_dtypes.Aval, ...] = ()
        self.fused = False
        self.res_def: Any = None
        self.res_avals: list[jax.ShapeDtypeStruct] = []
        self._backward: Runner | None = None
        self._vjp_function: TorchFunction | None = None
        self._jvp_function: TorchFunction | None = None
        self._op_runners: tuple[Runner, Runner | None] | None = None
        self.uid = _custom_op.register_entry(self) if owner.compilable else -1

        self._program = jax.jit(self._forward_with_vjp if self.diff else self._forward)
        with trace_context(self.device_type):
            self._program.trace(*(jax.ShapeDtypeStruct(*aval) for aval in self.in_avals))
        self.n_out = len(self.out_avals)
        self.out_is_leaf = self.n_out == 1 and jax.tree_util.treedef_is_leaf(self.out_def)
        self.float_outputs = tuple(
            i for i, (_, dtype) in enumerate(self.out_avals) if _dtypes.is_differentiable(dtype)
        )
        self.non_diff_outputs = tuple(
            i for i in range(self.n_out) if i not in frozenset(self.float_outputs)
        )
        n_exported = self.n_out + (len(self.diff) if self.fused else 0)
        self.mesh = _mesh_of(statics)
        self.forward = runner_for(
            self.device_type, self._program, self.in_avals, n_exported, self.mesh
        )

    # Traced JAX functions. Each counts as a trace of the owner.

    def _outputs(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        leaves = list(self.statics)
        for position, array in zip(self.tensor_positions, arrays, strict=True):
            leaves[position] = array
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        try:
            result = self.owner.jax_fn(*args, **kwargs)
        except TypeError as err:
            if "Tracer" in str(err) and "Tensor" in str(err):
                raise TypeError(
                    f"{self.owner!r}: a torch operation got a JAX value ({err}). The function "
                    "runs on JAX arrays while it is traced: write it with jax.numpy (jnp.sum, "
                    "jnp.tanh, ...), not torch, and pass torch tensors as its arguments rather "
                    "than closing over them."
                ) from err
            raise
        path_leaves, out_def = jax.tree_util.tree_flatten_with_path(result)
        for path, leaf in path_leaves:
            if not isinstance(leaf, jax.Array):
                raise TypeError(
                    f"{self.owner!r} returned a non-array leaf at "
                    f"output{jax.tree_util.keystr(path)}: expected a JAX array, got "
                    f"{type(leaf).__name__}: {leaf!r}. Return "
                    "jnp.asarray(value), or pass non-array results outside the function."
                )
        out_avals = tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for _, leaf in path_leaves)
        for _, dtype in out_avals:
            _dtypes.torch_dtype(dtype)  # Raises for a dtype torch does not have.
        if self.out_def is not None and (out_def, out_avals) != (self.out_def, self.out_avals):
            raise ValueError(
                f"{self.owner!r}: the output tree changed between two traces of the same call "
                f"signature: first {self.out_def} with {self.out_avals}, now {out_def} with "
                f"{out_avals}. A JAX function must return the same structure, shapes and dtypes "
                "for the same inputs; do not branch on Python state that changes between calls."
            )
        self.out_def, self.out_avals = out_def, out_avals
        return [leaf for _, leaf in path_leaves]

    def _with(
        self, positions: tuple[int, ...], arrays: Sequence[jax.Array], *varied: jax.Array
    ) -> list[jax.Array]:
        """The outputs, with the inputs at `positions` replaced by `varied`."""
        full = list(arrays)
        for i, array in zip(positions, varied, strict=True):
            full[i] = array
        return self._outputs(full)

    def _forward(self, *arrays: jax.Array) -> list[jax.Array]:
        self.owner._count_trace()
        return self._outputs(arrays)

    def _forward_with_vjp(self, *arrays: jax.Array) -> list[jax.Array]:
        self.owner._count_trace()
        outputs, vjp = jax.vjp(
            functools.partial(self._with, self.diff, arrays), *(arrays[i] for i in self.diff)
        )
        if (
            len(outputs) == 1
            and outputs[0].shape == ()
            and _dtypes.is_differentiable(outputs[0].dtype)
        ):
            # A scalar's VJP is linear in its one cotangent: computing the gradient now and
            # scaling it in backward is exact and keeps no residuals.
            self.fused = True
            return [*outputs, *vjp([jnp.ones((), outputs[0].dtype)])]
        residuals, self.res_def = jax.tree_util.tree_flatten(vjp)
        self.res_avals = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in residuals]
        return [*outputs, *residuals]

    def _cotangents(self, float_cotangents: Sequence[jax.Array]) -> list[jax.Array]:
        given = iter(float_cotangents)
        # Outputs torch does not differentiate get zero cotangents: of their own dtype where
        # JAX differentiates them (complex), float0 where it does not (integers, bools).
        return [
            next(given)
            if i in self.float_outputs
            else np.zeros(shape, dtype if jnp.issubdtype(dtype, jnp.inexact) else jax.dtypes.float0)
            for i, (shape, dtype) in enumerate(self.out_avals)
        ]

    def _backward_program(self, *flat: jax.Array) -> list[jax.Array]:
        self.owner._count_trace()
        k = len(self.float_outputs)
        vjp = jax.tree_util.tree_unflatten(self.res_def, flat[k:])
        return list(vjp(self._cotangents(flat[:k])))

    def _vjp(self, arrays: list[jax.Array], float_cotangents: list[jax.Array]) -> list[jax.Array]:
        _, vjp = jax.vjp(
            functools.partial(self._with, self.diff, arrays), *(arrays[i] for i in self.diff)
        )
        return list(vjp(self._cotangents(float_cotangents)))

    # Torch-side backward.

    def backward(self, call: _Call, grad_outputs: Sequence[torch.Tensor]) -> list[Any]:
        """Gradients for every tensor input of `call` (None where none is needed)."""
        cotangents = [grad_outputs[i] for i in self.float_outputs]
        if torch.is_grad_enabled() or call.saved is None:
            # create_graph=True, or another backward through a fused call whose gradients an
            # earlier one handed over: recompute through a torch function of the VJP (itself
            # differentiable) instead of using saved, constant values.
            call.check_versions()
            grads = self.vjp_function()(list(call.tensors), cotangents)
        elif self.fused:
            (scale,) = cotangents
            # Keeping no reference lets AccumulateGrad adopt the gradients as .grad uncopied.
            grads, call.saved = call.saved, None
            if not (scale.device.type == "cpu" and scale.item() == 1.0):
                grads = [g * scale.to(g.dtype) for g in grads]
        else:
            grads, _ = self.backward_runner()(cotangents, call.saved)
        result: list[Any] = [None] * len(call.tensors)
        for i, grad in zip(self.diff, grads, strict=True):
            result[i] = grad
        return result

    def backward_runner(self) -> Runner:
        """The compiled VJP over residuals (built at the first backward)."""
        if self._backward is None:
            with self.owner._lock:
                if self._backward is None:
                    program = self._traced_backward_program()
                    self._backward = runner_for(
                        self.device_type, program, self.cotangent_avals(), len(self.diff), self.mesh
                    )
        return self._backward

    def cotangent_avals(self) -> list[_dtypes.Aval]:
        """Shapes and dtypes of the cotangents backward takes (one per float output)."""
        return [self.out_avals[i] for i in self.float_outputs]

    def extra_avals(self) -> list[_dtypes.Aval]:
        """Shapes and dtypes of what forward computes for backward: gradients or residuals."""
        if self.fused:
            return [self.in_avals[i] for i in self.diff]
        return [(tuple(r.shape), np.dtype(r.dtype)) for r in self.res_avals]

    def _traced_backward_program(self) -> Any:
        program = jax.jit(self._backward_program)
        with trace_context(self.device_type):
            program.trace(
                *(jax.ShapeDtypeStruct(*aval) for aval in self.cotangent_avals()), *self.res_avals
            )
        return program

    def op_runners(self) -> tuple[Runner, Runner | None]:
        """Runners for the custom-op path, where residuals cross to torch as tensors.

        The first runs forward and exports outputs plus `extra_avals`; the second (None for a
        fused entry) takes cotangents and residual tensors and returns the gradients.
        """
        if self._op_runners is None:
            with self.owner._lock:
                if self._op_runners is None:
                    n_total = self.n_out + len(self.extra_avals())
                    forward = runner_for(
                        self.device_type, self._program, self.in_avals, n_total, self.mesh
                    )
                    backward = None
                    if self.diff and not self.fused:
                        backward = runner_for(
                            self.device_type,
                            self._traced_backward_program(),
                            [*self.cotangent_avals(), *self.extra_avals()],
                            len(self.diff),
                            self.mesh,
                        )
                    self._op_runners = (forward, backward)
        return self._op_runners

    def jvp(self, primals: Sequence[torch.Tensor], tangents: Sequence[Any]) -> list[Any]:
        """Tangents of the outputs (None for non-float ones) given tangents of the inputs."""
        positions = tuple(
            i
            for i, t in enumerate(tangents)
            if t is not None and _dtypes.is_differentiable(self.in_avals[i][1])
        )
        given = [tangents[i].to(primals[i].dtype) for i in positions]
        if self._jvp_function is None:
            with self.owner._lock:
                if self._jvp_function is None:
                    self._jvp_function = TorchFunction(self._jvp, name=f"the JVP of {self.owner!r}")
        out = iter(self._jvp_function(list(primals), given, positions))
        return [next(out) if i in self.float_outputs else None for i in range(self.n_out)]

    def _jvp(
        self, arrays: list[jax.Array], tangents: list[jax.Array], positions: tuple[int, ...]
    ) -> list[jax.Array]:
        outputs = functools.partial(self._with, positions, arrays)
        _, out_tangents = jax.jvp(outputs, [arrays[i] for i in positions], tangents)
        return [out_tangents[i] for i in self.float_outputs]

    def vjp_function(self) -> TorchFunction:
        """The VJP (inputs, cotangents) -> gradients as a torch function of its own."""
        if self._vjp_function is None:
            with self.owner._lock:
                if self._vjp_function is None:
                    self._vjp_function = TorchFunction(self._vjp, name=f"the VJP of {self.owner!r}")
        return self._vjp_function


class _Call:
    """One differentiable call: its entry, inputs, and what backward needs from forward."""

    __slots__ = ("entry", "forward_mode", "saved", "tensors", "versions")

    def __init__(
        self, entry: _Entry, tensors: list[torch.Tensor], *, forward_mode: bool = False
    ) -> None:
        # Only the Python apply (torch.func, forward-mode AD) may need primals for jvp: saving
        # them costs every other differentiable call a little.
        self.forward_mode = forward_mode
        self.entry = entry
        self.tensors = tensors
        self.versions = [t._version for t in tensors]
        self.saved: list[Any] | None = []

    def check_versions(self) -> None:
        """Raises if an input changed in place since forward (double backward reads inputs)."""
        for i, (tensor, version) in enumerate(zip(self.tensors, self.versions, strict=True)):
            if tensor._version != version:
                raise RuntimeError(
                    f"{self.entry.owner!r}: tensor input {i} (shape {tuple(tensor.shape)}) was "
                    f"modified in place after the call (version {version} -> {tensor._version}); "
                    "this backward (with create_graph=True, or a second one through "
                    "retain_graph=True) recomputes from the inputs and needs their original "
                    "values. Clone the tensor before modifying it, or run backward first."
                )


class _JaxCall(torch.autograd.Function):
    """The one autograd node of a TorchFunction call; the first input carries the call state."""

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entry = call.entry
        exported, carried = entry.forward(tensors, ())
        n = entry.n_out
        call.saved = exported[n:] if entry.fused else carried
        return tuple(exported[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        call = inputs[0]
        ctx.call = call
        if call.forward_mode:
            ctx.save_for_forward(*inputs[1:])
        if call.entry.non_diff_outputs:
            ctx.mark_non_differentiable(*(output[i] for i in call.entry.non_diff_outputs))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        call = ctx.call
        return (None, *call.entry.backward(call, grad_outputs))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        return tuple(ctx.call.entry.jvp(ctx.saved_tensors, tangents))

    @staticmethod
    def vmap(info: Any, in_dims: Any, call: _Call, *tensors: torch.Tensor) -> Any:
        raise NotImplementedError(
            f"torch.func.vmap over {call.entry.owner!r} is not supported (nor jacfwd, jacrev "
            "and hessian, which use it): JAX cannot see torch's batching. Batch inside JAX "
            "instead: jax.vmap (or jax.jacfwd / jax.jacrev) in the JAX function, or map_fn "
            "over a placement."
        )


# `_JaxCall.apply` through torch's C++ apply, without Python Function.apply's argument binding.
_apply = _torch_compat.autograd_apply(_JaxCall)


def _statics(leaves: list[Any]) -> list[Any]:
    """A call's leaves with each tensor replaced by the tensor marker."""
    return [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def _mesh_of(statics: Sequence[Any]) -> Mesh | None:
    """The multi-device mesh a call runs on: a Mesh argument, else the one `jax.set_mesh` set."""
    for leaf in statics:
        if isinstance(leaf, Mesh) and leaf.size > 1:
            return leaf
    get_mesh = getattr(jax.sharding, "get_mesh", None)  # Not in every supported jax.
    mesh = get_mesh() if get_mesh is not None else None
    return mesh if mesh is not None and not mesh.empty and mesh.size > 1 else None


def _check_tensor(owner: TorchFunction, tensor: torch.Tensor, where: str) -> None:
    """Raises for a tensor no runner can pass to JAX, naming it by `where`."""
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{owner!r}: {where} is a {str(tensor.layout).removeprefix('torch.')} tensor of "
            f"shape {tuple(tensor.shape)}; JAX takes dense (strided) tensors only. Convert it "
            "with .to_dense() first, or pass its parts (indices and values) as dense tensors."
        )
    if _torch_compat.dispatches_to_python(tensor):
        raise TypeError(
            f"{owner!r}: {where} is a {type(tensor).__qualname__}, a tensor subclass with "
            "__torch_dispatch__: its ops run Python code and its memory need not hold its "
            "values, so JAX cannot read it. Pass the plain tensors it holds instead."
        )
    kind = tensor.device.type
    if kind == "meta":
        raise TypeError(
            f"{owner!r}: {where} is a meta tensor of shape {tuple(tensor.shape)}: it has no "
            "data to compute with. Materialise it first, e.g. torch.empty_like(t, "
            "device='cpu'), or model.to_empty(device='cpu') and initialise the parameters."
        )
    if kind not in _DEVICE_TYPES:
        raise TypeError(
            f"{owner!r}: {where} is on device {tensor.device}; bridge_mr runs JAX on CPU, CUDA "
            "and torch-xla tensors. Move it with .to('cpu') (or to a CUDA or XLA device) first."
        )


def _flatten_error(
    owner: TorchFunction, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Exception:
    """The error for arguments JAX cannot flatten: a dict whose keys do not sort."""
    names = list(owner.arg_names) + [f"args[{i}]" for i in range(len(owner.arg_names), len(args))]
    roots = [*zip(names, args, strict=False), *((str(k), v) for k, v in kwargs.items())]
    for name, tree in roots:
        found = _unsortable_dict(tree, name)
        if found is not None:
            path, keys = found
            listing = ", ".join(f"{k!r} ({type(k).__name__})" for k in keys[:6])
            return TypeError(
                f"{owner!r}: {path} is a dict whose keys are of mixed types ({listing}); JAX "
                "sorts dict keys to flatten a pytree, and these do not sort. Use keys of one "
                "type, e.g. str: {str(k): v for k, v in d.items()}."
            )
    return TypeError(
        f"{owner!r}: the arguments are not a pytree JAX can flatten; see the error above."
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


def _leaf_paths(treedef: Any, arg_names: Sequence[str]) -> list[str]:
    """Readable paths ("server['w']", "args[3]") of the leaves of a flattened (args, kwargs)."""
    marker = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
    paths = [""] * treedef.num_leaves
    for path, index in jax.tree_util.tree_flatten_with_path(marker)[0]:
        kind, arg, *rest = path
        if kind.idx == 1:
            head = str(arg.key)
        elif arg.idx < len(arg_names):
            head = arg_names[arg.idx]
        else:
            head = f"args[{arg.idx}]"
        paths[index] = head + jax.tree_util.keystr(tuple(rest))
    return paths


def _device_error(owner: TorchFunction, tensors: list[torch.Tensor], where: list[str]) -> Exception:
    by_device: dict[torch.device, list[str]] = {}
    for tensor, w in zip(tensors, where, strict=True):
        by_device.setdefault(tensor.device, []).append(w)
    listing = "; ".join(f"{device}: {', '.join(ws[:3])}" for device, ws in by_device.items())
    return ValueError(
        f"{owner!r} got tensors on different devices in one call ({listing}). One call runs "
        "on one device: move them with .to(device) first."
    )


def _static_error(
    owner: TorchFunction, treedef: Any, statics: list[Any], tensors: list[torch.Tensor]
) -> Exception:
    paths = _leaf_paths(treedef, owner.arg_names)
    for path, leaf in zip(paths, statics, strict=True):
        if isinstance(leaf, jax.Array):
            if tensors:
                return TypeError(
                    f"{owner!r} got torch tensors and JAX arrays in one call ({path} is a "
                    f"jax.Array of shape {leaf.shape}). Pass torch tensors only (convert with "
                    "bridge_mr.dlpack.to_torch), or call the JAX function directly on JAX arrays."
                )
            return TypeError(
                f"{owner!r} got a jax.Array at {path} but no torch tensors: it is a torch "
                "function. Call the JAX function directly on JAX arrays, or pass torch tensors."
            )
        if isinstance(leaf, np.ndarray):
            return TypeError(
                f"{owner!r} got a numpy array at {path}; pass it as a torch tensor "
                "(torch.from_numpy(x)) so it becomes a traced input."
            )
        try:
            hash(leaf)
        except TypeError:
            return TypeError(
                f"{owner!r}: {path} is a {type(leaf).__name__}, which is neither a torch tensor "
                "nor hashable. Non-tensor arguments are static (part of the compile key) and "
                "must be hashable; pass a tensor, or a hashable value such as a tuple."
            )
    return TypeError(f"{owner!r}: the call's static arguments are not hashable.")
