"""`torch_function`: a JAX function as a differentiable torch function over pytrees of tensors.

A call goes one way: its key (`_keys.call_key`) finds the signature's `Entry`, built once
per key: the traced call (`_traced.trace`), the runner of its forward program (chosen by the
tensors' device) and its backward strategy (`_autograd.Backward`); `_autograd.apply` runs it.
"""

from __future__ import annotations

import functools
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import torch

from bridge_mr import _caches
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import Aval
from bridge_mr.dlpack import tensor_avals
from bridge_mr.typing import PyTree

from . import _custom_op, _keys, _signature
from ._autograd import Backward, Entry, run
from ._signature import TENSOR
from ._static import FunctionIdentity
from ._traced import CallSpec, TraceCounter, TracedCall, forward_runner, trace

_MAX_ENTRIES = 256
_MAX_IDENTITY_ENTRIES = 16
# After this many traces caused by re-created functions of one code object, warn once.
_RETRACE_WARNING_AT = 3
_GRAPH_BREAK_RESUMES = torch_compat.graph_break_resumes()

# Every TorchFunction, for `clear_caches` (weakly: a function nobody holds is freed).
_ALL: weakref.WeakSet[TorchFunction] = weakref.WeakSet()


class JaxFunction(Protocol):
    """A JAX function: pytrees of arrays (and static values) in, a pytree of arrays out."""

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree: ...


class RetraceWarning(UserWarning):
    """A call traced again because its function is new each time and cannot be keyed by value.

    Warned once per code object, after a few traces of new function objects of it that read
    something bridge_mr cannot compare by value (a dict, a list, a mutable object, a tensor).

    Example:
      >>> import warnings
      >>> f = bridge_mr.torch_function(lambda fn, x: fn(x))  # fn: a static argument
      >>> config = {"scale": 2.0}  # a dict: not comparable by value
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     for _ in range(3):  # a new lambda on each call: traced each time
      ...         _ = f(lambda x: x * config["scale"], torch.ones(2))
      >>> [w.category.__name__ for w in caught], f.trace_count
      (['RetraceWarning'], 3)
    """


class TorchFunction:
    """A JAX function callable on pytrees of torch tensors, differentiable by torch autograd.

    Tensor leaves of the arguments become JAX arrays; every other leaf (a number, a string, a
    callable, a mesh) is static: it is part of the compile key and must be hashable, so pass a
    tensor for a value that changes from call to call. A static function (a lambda, a
    `functools.partial`) is keyed by its code, defaults and captured values, so one re-created
    on every call does not trace again. Outputs come back as torch tensors in the structure the
    JAX function returns. Each distinct signature (tree structure, static values, shapes,
    dtypes, devices, which inputs need gradients, grad mode, the active placement and mesh,
    JAX's configuration) is traced once; `trace_count` says how many JAX traces this function
    has done so far, and `clear_cache()` drops them.

    Args:
      jax_fn: the JAX function.
      compilable: make calls a `torch.library` custom op that `torch.compile` traces (see
        `torch_function`).
      passthrough_jax: a call whose arguments hold no torch tensor is a plain call of the JAX
        function (JAX arrays in, JAX arrays out).
      name: what error messages call the function (default: `torch_function(<qualname>)`).
      arg_names: the names of the positional parameters, for error messages.

    Raises:
      TypeError: `jax_fn` is not callable.

    Example:
      >>> f = bridge_mr.TorchFunction(lambda w, x: jnp.tanh(x @ w).sum(), arg_names=("w", "x"))
      >>> w = torch.randn(3, 2, requires_grad=True)
      >>> f(w, torch.randn(4, 3)).backward()  # w.grad is set
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
        self._entries, self._identity_keys = _bounded_entries()
        # Entries a caller in this package finds by its own, cheaper key (`map_reduce`'s
        # cached calls): read directly, added to by `_remember`, cleared with the cache.
        self._hits, self._identity_hits = _bounded_entries()
        # Per code object: how many distinct function objects of it were traced, and the last.
        self._retraces: dict[Any, tuple[int, int, int]] = {}
        self._lock = threading.RLock()
        self._counter = TraceCounter()
        self._uid = _custom_op.register(self) if compilable else ""
        _ALL.add(self)

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
        return self._counter.count

    def clear_cache(self) -> None:
        """Drops this function's traced programs, and with them what their arguments held.

        The next call of each signature traces again; `trace_count` keeps counting.

        Example:
          >>> f = bridge_mr.torch_function(lambda x: jnp.sin(x).sum())
          >>> _ = f(torch.ones(3))
          >>> f.trace_count
          1
          >>> f.clear_cache()
          >>> _ = f(torch.ones(3))  # traced again
          >>> f.trace_count
          2
        """
        with self._lock:
            self._entries.clear()
            self._identity_keys.clear()
            self._hits.clear()
            self._identity_hits.clear()
            self._retraces.clear()

    def __repr__(self) -> str:
        if self._name is not None:
            return self._name
        name = getattr(self._jax_fn, "__qualname__", None) or repr(self._jax_fn)
        return f"torch_function({name})"

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        if self.compilable:
            return _custom_op.call(self, self._uid, args, kwargs)
        if torch.compiler.is_compiling():
            # torch.compile cannot trace into JAX: this call runs eagerly, between two graphs.
            # The explicit break carries the reason (fullgraph=True reports it); the disabled
            # call is built here, not ahead, as building one imports torch._dynamo.
            if _GRAPH_BREAK_RESUMES:
                torch_compat.graph_break(
                    f"bridge_mr: {self!r} runs a JAX program, which torch.compile cannot "
                    "trace, so it runs eagerly between two graphs. Under fullgraph=True, call a "
                    "JAX function made with bridge_mr.torch_function(jax_fn, compilable=True) "
                    "instead: a torch.library custom op that torch.compile traces (put the "
                    "broadcast / map_fn / reduce_* of a map_reduce inside jax_fn, under "
                    "@bridge_mr.program)."
                )
            return self._without_dynamo(args, kwargs)
        hook = torch_compat.eval_frame_callback()
        if hook is not None and hook is not False:  # False: Dynamo runs compiled code only.
            # Dynamo runs this frame eagerly (it skips this code, e.g. after a failed trace) and
            # would compile each frame it calls, JAX's too: run the call without it.
            return self._without_dynamo(args, kwargs)
        return self._call(args, kwargs)

    def _without_dynamo(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
        # torch.compiler.disable is unannotated (torch 2.13): it returns its argument, disabled.
        disabled = cast(
            Callable[[tuple[Any, ...], dict[str, Any]], PyTree], torch.compiler.disable(self._call)
        )
        return disabled(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
        found = self._lookup(args, kwargs)
        if found is None:
            return self._jax_fn(*args, **kwargs)
        return run(*found)

    def _lookup(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Entry, list[torch.Tensor], list[jax.Array]] | None:
        """The entry of a call's signature (traced on a miss), the call's tensors and its JAX
        array inputs, each in order; None for a call with no tensor of a `passthrough_jax`
        function (a plain JAX call).

        Raises:
          TypeError: the arguments cannot be flattened, or a static leaf is not hashable, or a
            tensor or JAX array cannot be passed to the program (the message names it).
        """
        try:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        except (TypeError, ValueError) as err:
            raise _signature.flatten_error(repr(self), self.arg_names, args, kwargs) from err
        grad = torch.is_grad_enabled()
        key, tensors, arrays = _keys.call_key(leaves, treedef, grad)
        if not tensors:
            if self._passthrough_jax:
                return None
            if arrays:
                raise _signature.arrays_error(
                    repr(self), self.arg_names, treedef, leaves, "a torch function needs torch "
                    "tensors, and this call has none.", "Call the JAX function directly on JAX "
                    "arrays, or pass torch tensors.")  # fmt: skip
        try:
            entry = self._entries.get(key)
        except TypeError:
            raise _signature.static_error(
                repr(self), self.arg_names, treedef, _signature.statics(leaves)
            ) from None
        if entry is None:
            entry = self._entry(key, treedef, leaves, tensors, grad)
        return entry, tensors, arrays

    def _remember(self, key: Any, entry: Entry, *, by_identity: bool) -> None:
        """Keeps `entry` in `_hits` under a caller's own `key` (hashable), within the bounds
        (`by_identity`: the key holds a function by identity, bounded more tightly)."""
        with self._lock:
            _keep(self._hits, self._identity_hits if by_identity else None, key, entry)

    def _entry(
        self,
        key: tuple[Any, ...],
        treedef: Any,
        leaves: Sequence[Any],
        tensors: Sequence[torch.Tensor],
        grad: bool,
    ) -> Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            identities = _keys.function_identities(key)
            if identities:
                self._note_retrace(identities)
            statics = _signature.statics(leaves)
            diff = tuple(i for i, t in enumerate(tensors) if grad and t.requires_grad)
            spec = self._spec(treedef, statics, tensors, diff)
            if spec.array_positions:
                _signature.check_arrays(spec.name, self.arg_names, spec.treedef, leaves,
                                        spec.device_type, spec.mesh, spec.layout,
                                        spec.program_device)  # fmt: skip
            entry = self._new_entry(trace(spec, self._counter))
            _keep(self._entries, self._identity_keys if identities else None, key, entry)
            return entry

    def _spec(
        self,
        treedef: Any,
        statics: tuple[Any, ...],
        tensors: Sequence[torch.Tensor],
        diff: tuple[int, ...],
    ) -> CallSpec:
        """The call signature to trace, with the tensors checked (raises naming a bad one)."""
        name = repr(self)
        where = self._tensor_names(treedef, statics)
        if len({t.device for t in tensors}) > 1:
            raise _signature.device_error(name, tensors, where)
        for tensor, w in zip(tensors, where, strict=True):
            _signature.check_tensor(name, tensor, w)
        in_avals = tensor_avals(tensors, [f"{name}: {w}" for w in where])
        layout = _signature.layout_of(statics)
        per_rank: tuple[bool, ...] = ()
        if layout is not None:
            per_rank = tuple(
                w.removeprefix("argument ").split("[", 1)[0] in layout.per_rank for w in where
            )
            in_avals = tuple(
                (layout.global_shape(shape), dtype) if p else (shape, dtype)
                for (shape, dtype), p in zip(in_avals, per_rank, strict=True)
            )
        for i in diff:
            if tensors[i].dtype.is_complex:
                raise _signature.complex_grad_error(name, where[i])
        device_type = tensors[0].device.type if tensors else "cpu"
        mesh = _signature.mesh_of(statics)
        return CallSpec(
            fn=self._jax_fn,
            name=name,
            treedef=treedef,
            statics=statics,
            in_avals=in_avals,
            diff=diff,
            device_type=device_type,
            mesh=mesh,
            layout=layout,
            per_rank=per_rank,
            program_device=_signature.program_device(device_type, mesh, layout),
        )

    def _tensor_names(self, treedef: Any, statics: tuple[Any, ...]) -> list[str]:
        """What errors call each tensor argument of a call ("argument clients['y']")."""
        paths = _signature.leaf_paths(treedef, self.arg_names)
        return [f"argument {paths[i]}" for i, s in enumerate(statics) if s is TENSOR]

    def _new_entry(self, traced: TracedCall) -> Entry:
        spec = traced.spec
        # Names a value the runner finds out of range (an int64 label, x64 off).
        names = [f"{spec.name}: {w}" for w in self._tensor_names(spec.treedef, spec.statics)]
        return Entry(traced, forward_runner(traced, names), Backward(traced, _derived))

    def trace_op(
        self, in_avals: tuple[Aval, ...], device_type: str, diff: tuple[int, ...]
    ) -> TracedCall:
        """Traces the custom-op signature of positional tensors with `in_avals`.

        The dispatcher hands the op plain tensors, or fake ones to trace: none to check.

        Args:
          in_avals: the (shape, numpy dtype) of each positional tensor.
          device_type: the tensors' torch device type ("cpu", "cuda", ...).
          diff: the positions of the tensors that need gradients.

        Returns:
          The `TracedCall`: the forward program and what the trace found.

        Example:
          >>> f = bridge_mr.torch_function(lambda x: jnp.sin(x).sum())
          >>> traced = f.trace_op((((3,), np.dtype("float32")),), "cpu", (0,))
          >>> traced.outputs.n_out, traced.grad_avals  # one output; a gradient for x
          (1, (((3,), dtype('float32')),))
        """
        n = len(in_avals)
        statics = (TENSOR,) * n
        mesh = _signature.mesh_of(statics)
        spec = CallSpec(
            fn=self._jax_fn,
            name=repr(self),
            treedef=jax.tree_util.tree_structure((tuple(range(n)), {})),
            statics=statics,
            in_avals=in_avals,
            diff=diff,
            device_type=device_type,
            mesh=mesh,
            program_device=_signature.program_device(device_type, mesh, None),
        )
        return trace(spec, self._counter)

    def _note_retrace(self, identities: list[FunctionIdentity]) -> None:
        """Warns (once per code object) when new function objects keep being traced.

        A new shape for the same function object is an ordinary trace, not counted; nor is a
        function that reads another object than the last one did (a closure over another
        model is another function, not the same one re-created).
        """
        for identity in identities:
            code = identity.code()
            count, last, value = self._retraces.get(code, (0, 0, identity.value_id))
            if id(identity.fn) == last:
                continue
            count = count + 1 if value == identity.value_id else 1
            self._retraces[code] = (count, id(identity.fn), identity.value_id)
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


def _bounded_entries() -> tuple[_caches.Bounded[Any, Entry], _caches.Bounded[Any, None]]:
    """Entries (at most 256) and their keys that hold a function by identity (at most 16:
    a function re-created on every call adds one per call); the oldest go first."""
    entries = _caches.Bounded[Any, Entry](_MAX_ENTRIES)

    def drop(key: Any) -> None:
        entries.pop(key, None)

    return entries, _caches.Bounded(_MAX_IDENTITY_ENTRIES, on_drop=drop)


def _keep(
    entries: _caches.Bounded[Any, Entry],
    identity_keys: _caches.Bounded[Any, None] | None,
    key: Any,
    entry: Entry,
) -> None:
    """Adds `entry` under `key` (and the key to `identity_keys`, None for a key that holds no
    function by identity), within their bounds."""
    if identity_keys is not None:
        identity_keys.put(key, None)
    entries.put(key, entry)


def _derived(jax_fn: Any, name: str) -> TorchFunction:
    """A torch function of a program derived from a call (its VJP or JVP)."""
    return TorchFunction(jax_fn, name=name)


def _rebuild(state: dict[str, Any]) -> TorchFunction:
    return TorchFunction(**state)


def clear_all() -> None:
    """Drops the traced programs of every torch function."""
    for fn in list(_ALL):
        fn.clear_cache()


_caches.register_clear("torch function traces", clear_all)


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

    Args:
      jax_fn: a JAX function of pytrees of arrays (tensor leaves) and static values.
      compilable: make it a `torch.library` custom op for `torch.compile(fullgraph=True)`.

    Returns:
      A `TorchFunction`: call it on torch tensors; it returns torch tensors.

    Raises:
      TypeError: `jax_fn` is not callable.

    Example:
      >>> loss = bridge_mr.torch_function(lambda w, x: jnp.mean((x @ w) ** 2))
      >>> w = torch.randn(3, 1, requires_grad=True)
      >>> loss(w, torch.randn(8, 3)).backward()  # w.grad holds the JAX gradient
    """
    return TorchFunction(jax_fn, compilable=compilable)
