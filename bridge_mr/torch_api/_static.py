"""Compile-cache keys for static (non-tensor) arguments, functions included.

The rule: a call never reuses a trace that a fresh `jax.jit` of the same function would not
reuse. `jax.jit` reuses a trace for the *same function object* (even if state it read while
tracing has changed since: JAX's documented gotcha) and traces a *new* function object again.

A function passed as a static argument (the `fn` of `map_fn` or `map_reduce`) is often a lambda,
a `functools.partial` or a bound method built anew on every call. Such a function is keyed by
value -- its code, the globals its code reads, its defaults, the values it closes over (bound
methods: their `self`) -- when every one of those is a value bridge_mr can compare: numbers,
strings, bytes, None, tuples and frozensets of those, frozen dataclasses of those, immutable JAX
and numpy arrays (by identity), dtypes, meshes and shardings, and definitions (modules, classes,
builtins, `jax.jit` / `custom_jvp` / `custom_vjp` functions, enum members, other functions keyed
the same way). Two such functions with equal keys trace the same program, so a re-created one
hits the cache. If any captured value is anything else (a dict, a list, a mutable object such as
a trainer, a torch tensor), the function is keyed by its identity, as `jax.jit` keys it: the same
object reuses its trace, a re-created one traces again.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import operator
import types
from typing import TYPE_CHECKING, Any, TypeGuard

import jax
import jax.core
import numpy as np
import torch

from bridge_mr import _caches

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FUNCTION_TYPES = (types.FunctionType, functools.partial, types.MethodType)


def static_key(value: Any) -> Any:
    """A hashable key that is equal for static values that trace the same way.

    Unlike `==`, it tells 1 from 1.0 and True (they trace to different dtypes), and 0.0 from
    -0.0; a NaN equals itself. Unhashable values give an unhashable key.
    """
    if isinstance(value, FUNCTION_TYPES):
        return function_key(value)
    return _typed(value, type(value))


def _typed(value: Any, kind: type) -> tuple[Any, ...]:
    """`value` with its type; floats by their bits (-0.0 is not 0.0, a NaN equals itself)."""
    if kind is float:
        return (float, value.hex())
    if kind is complex:
        return (complex, value.real.hex(), value.imag.hex())
    return (kind, value)


def function_key(fn: Any) -> Any:
    """The key of a function: by value where its captures allow, else `FunctionIdentity`.

    A value key is reused while everything its walk read is the same object as when it was
    built: for every plain function the walk went through (`fn` and the functions it reads),
    its code, defaults, the globals its code names and its cells. Those are the only parts of
    such a key that can be rebound; everything else in it is immutable (numbers, tuples, frozen
    dataclasses, partials' and methods' parts), so the same objects give the same key and the
    walk is skipped. Keys that met a numpy array (whose writeable flag can change) are rebuilt
    on every call, and so are identity keys.
    """
    recent = _RECENT.get(id(fn))
    if recent is not None and recent[0] is fn:
        for reader, names, then in recent[1]:
            namespace = reader.__globals__
            now = (
                reader.__code__,
                reader.__defaults__,
                reader.__kwdefaults__,
                *map(namespace.get, names, itertools.repeat(_MISSING, len(names))),
            )
            if reader.__closure__ is not None:
                now = (*now, *map(_cell_contents, reader.__closure__))
            if len(now) != len(then) or not all(map(operator.is_, now, then)):
                break
        else:
            return recent[2]
    walk = _ValueWalk()
    try:
        key = _ValueKey(_function_parts(fn, walk), walk.keep)
    except _NotByValue as err:
        # Not kept: holding the function would hold the mutable values it reads after its
        # traces are cleared.
        return FunctionIdentity(fn, err.what, err.reader, err.value_id)
    if not walk.arrays:
        _RECENT.put(id(fn), (fn, tuple(walk.readers), key))
    return key


# Recent functions keyed by value, by id: (the function, what its key's walk read: per plain
# function walked, the function, the global names its code reads and the objects it read; its
# key). Holding the function keeps its id from being reused.
_Reader = tuple[types.FunctionType, tuple[str, ...], tuple[Any, ...]]
_RECENT: _caches.Bounded[int, tuple[Any, tuple[_Reader, ...], _ValueKey]]
_RECENT = _caches.register("torch function identities", _caches.Bounded(256))
_MISSING = object()


def _reads(fn: types.FunctionType, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The objects a plain function's key depends on: its code, defaults, named globals, cells."""
    namespace = fn.__globals__
    reads = (
        fn.__code__,
        fn.__defaults__,
        fn.__kwdefaults__,
        *map(namespace.get, names, itertools.repeat(_MISSING, len(names))),
    )
    if fn.__closure__ is None:
        return reads
    return (*reads, *map(_cell_contents, fn.__closure__))


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # Not assigned yet.
        return _MISSING


class FunctionIdentity:
    """Keys a function by identity; keeps it alive so that its id is not reused.

    `why` names the first captured value that could not be compared by value, and `reader`
    the code of the function that read it (None where no function body did: a method's
    `self`, a partial's argument).
    """

    __slots__ = ("fn", "reader", "value_id", "why")

    def __init__(
        self, fn: Any, why: str, reader: types.CodeType | None = None, value_id: int = 0
    ) -> None:
        self.fn = fn
        self.why = why
        self.reader = reader
        self.value_id = value_id  # id() of the value `why` names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionIdentity) and other.fn is self.fn

    def __hash__(self) -> int:
        return id(self.fn)

    def code(self) -> types.CodeType | None:
        """The code of the function that read the value, else the code behind the function
        (through partials and bound methods).

        Re-created functions count as retraces of this code: two conversions of different
        functions (`from_torch` closures share one code object) are not one function re-created.
        """
        if self.reader is not None:
            return self.reader
        fn = self.fn
        while isinstance(fn, (functools.partial, types.MethodType)):
            fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
        return getattr(fn, "__code__", None)


class _ValueKey(tuple):
    """Parts compared with ==; objects compared by identity enter as ids, kept alive in `keep`.

    Ids hash and compare in C, where identity wrappers would run Python on every lookup; while
    a key holds its objects, no other live object can have their ids. A tuple, so that hashing
    and comparing a key runs no Python either.
    """

    keep: list[Any]

    def __new__(cls, parts: tuple[Any, ...], keep: list[Any]) -> _ValueKey:
        key = super().__new__(cls, parts)
        key.keep = keep
        return key


class _ValueWalk:
    """The state of one key's construction: functions being keyed, objects keyed by identity."""

    __slots__ = ("arrays", "keep", "readers", "stack")

    def __init__(self) -> None:
        self.stack: set[int] = set()
        self.keep: list[Any] = []
        self.readers: list[_Reader] = []  # Plain functions walked, with what they read.
        self.arrays = False  # Whether a numpy array was met (its writeable flag can change).

    def ident(self, value: Any) -> int:
        self.keep.append(value)
        return id(value)


class _NotByValue(Exception):
    def __init__(self, what: tuple[Any, ...], value: Any) -> None:
        self.what = what[0].format(*what[1:])
        self.value_id = id(value)
        self.reader: types.CodeType | None = None  # The innermost function that read it.
        super().__init__(self.what)


# Immutable and hashable, compared by value.
_HASHABLE_VALUES = (
    type(None),
    bool,
    int,
    str,
    bytes,
    np.dtype,
    torch.dtype,
    torch.device,
    jax.sharding.Mesh,
    jax.sharding.AbstractMesh,
    jax.sharding.PartitionSpec,
    jax.sharding.Sharding,
)
_EXACT_HASHABLE = frozenset({type(None), bool, int, str, bytes})
# Definitions: compared by identity (rebinding one is not a change bridge_mr follows, as with jit).
_DEFINITIONS = (
    types.ModuleType,
    type,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    np.ufunc,
    jax.numpy.ufunc,
    enum.Enum,
    jax.stages.Wrapped,
    jax.custom_jvp,
    jax.custom_vjp,
    type(Ellipsis),
)


def _value(value: Any, what: tuple[Any, ...], walk: _ValueWalk) -> Any:
    """The key of one captured value; raises _NotByValue where it cannot compare by value.

    `what` describes the value for the error (a format string and its arguments, formatted
    only when needed: keys are built on every call).
    """
    kind = type(value)
    if kind in _EXACT_HASHABLE:
        return (kind, value)
    if kind is float or kind is complex:
        return _typed(value, kind)
    if kind is types.ModuleType or kind is types.FunctionType:
        return walk.ident(value) if kind is types.ModuleType else _function_parts(value, walk)
    if isinstance(value, _HASHABLE_VALUES):
        return (kind, value)
    if isinstance(value, FUNCTION_TYPES):
        return _function_parts(value, walk)
    if isinstance(value, (tuple, frozenset)):
        items = (_value(v, what, walk) for v in value)
        return (kind, frozenset(items) if isinstance(value, frozenset) else tuple(items))
    if isinstance(value, _DEFINITIONS):
        return walk.ident(value)
    if isinstance(value, np.generic):
        return (kind, value.tobytes())
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        return walk.ident(value)  # Immutable: the same array is the same value.
    if isinstance(value, np.ndarray):
        walk.arrays = True
        if _read_only(value):
            return walk.ident(value)
    if _frozen_dataclass(value):
        fields = dataclasses.fields(value)
        return (kind, tuple(_value(getattr(value, f.name), what, walk) for f in fields))
    raise _NotByValue(_with_type(what, kind), value)


def _with_type(what: tuple[Any, ...], kind: type) -> tuple[Any, ...]:
    return (what[0] + " (a {}.{})", *what[1:], kind.__module__, kind.__qualname__)


def _frozen_dataclass(value: Any) -> TypeGuard[DataclassInstance]:
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen and not isinstance(value, type)


def _read_only(array: np.ndarray) -> bool:
    """Whether no write can reach `array`'s memory: read-only down to an immutable owner."""
    base: Any = array
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return base is None or isinstance(base, bytes)


def _function_parts(fn: Any, walk: _ValueWalk) -> tuple[Any, ...]:
    if isinstance(fn, functools.partial):
        return (
            type(fn),
            _value(fn.func, ("the partial's function",), walk),
            tuple(_value(a, ("a partial argument",), walk) for a in fn.args),
            tuple(
                sorted(
                    (k, _value(v, ("partial argument {}", k), walk)) for k, v in fn.keywords.items()
                )
            ),
        )
    if isinstance(fn, types.MethodType):
        return (
            types.MethodType,
            _value(fn.__func__, ("the method",), walk),
            _value(fn.__self__, ("self of method {}", fn.__func__.__qualname__), walk),
        )
    code = fn.__code__
    key = id(fn)
    if key in walk.stack:  # A recursive reference: its captures are being keyed already.
        return (walk.ident(code),)
    walk.stack.add(key)
    names = _global_names(code)
    walk.readers.append((fn, names, _reads(fn, names)))
    try:
        name = fn.__qualname__
        namespace = fn.__globals__
        # Identity for the code: a re-created function shares its code object, and hashing
        # one by value hashes all its bytecode. Equal code from two modules reads other globals.
        parts: list[Any] = [walk.ident(code), walk.ident(namespace)]
        for g in names:
            if g in namespace:
                parts += (g, _value(namespace[g], ("global {!r} read by {}", g, name), walk))
        if fn.__defaults__ is not None:
            parts += [_value(d, ("a default of {}", name), walk) for d in fn.__defaults__]
        if fn.__kwdefaults__ is not None:
            for k, v in sorted(fn.__kwdefaults__.items()):
                parts += (k, _value(v, ("default {} of {}", k, name), walk))
        if fn.__closure__ is not None:
            parts.append(len(fn.__closure__))
            for var, cell in zip(code.co_freevars, fn.__closure__, strict=True):
                parts.append(_cell_value(cell, ("{!r} captured by {}", var, name), walk))
        return tuple(parts)
    except _NotByValue as err:
        if err.reader is None:
            err.reader = code
        raise
    finally:
        walk.stack.discard(key)


_NAMES: dict[int, tuple[types.CodeType, tuple[str, ...]]]
_NAMES = _caches.register("torch function global names", {})


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names `code` (and the code nested in it) may read as globals or attribute names.

    Cached by identity (the entry keeps its code alive, so the id is not reused).
    """
    cached = _NAMES.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    result = tuple(sorted(names))
    if len(_NAMES) < 4096:
        _NAMES[id(code)] = (code, result)
    return result


_EMPTY_CELL = ("<empty cell>",)


def _cell_value(cell: types.CellType, what: tuple[Any, ...], walk: _ValueWalk) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:  # A cell whose variable is not assigned yet.
        return _EMPTY_CELL
    return _value(value, what, walk)
