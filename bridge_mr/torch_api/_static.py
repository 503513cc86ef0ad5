"""Compile-cache keys for static (non-tensor) arguments, functions included.

A function passed as a static argument (the `fn` of `map_fn` or `map_reduce`) is often a
lambda or a `functools.partial` built anew on every call. Keyed by identity, each call would
trace and compile again; keyed by what determines its trace (code, globals, defaults and
captured values, the unhashable ones by identity) a re-created but equivalent function hits
the cache. (A global reassigned between calls is not seen, as with `jax.jit`.)
"""

from __future__ import annotations

import functools
import types
from typing import Any

FUNCTION_TYPES = (types.FunctionType, functools.partial)


def static_key(value: Any) -> Any:
    """A hashable key that is equal for static values that trace the same way."""
    if isinstance(value, FUNCTION_TYPES):
        return _FunctionKey(value)
    return value


class _Identity:
    """Compares by identity; keeps the object alive so that its id is not reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


# Captured values of these types are compared by value; any other by identity, since equality
# of arbitrary objects (tensors, arrays) may be elementwise, costly, or not say "same trace".
_VALUE_TYPES = (int, float, complex, str, bytes, type(None), types.CodeType, type)


def _captured_key(value: Any) -> Any:
    if isinstance(value, FUNCTION_TYPES):
        return static_key(value)
    if type(value) is tuple:
        return tuple(_captured_key(v) for v in value)
    if isinstance(value, _VALUE_TYPES):
        return (type(value), value)
    return _Identity(value)


class _FunctionKey:
    """Equal for functions with the same code, globals, defaults and captured values."""

    __slots__ = ("_globals", "_hash", "_parts")

    def __init__(self, fn: types.FunctionType | functools.partial[Any]) -> None:
        if isinstance(fn, functools.partial):
            self._globals = None
            parts: tuple[Any, ...] = (
                functools.partial,
                static_key(fn.func),
                tuple(_captured_key(a) for a in fn.args),
                tuple(sorted((k, _captured_key(v)) for k, v in fn.keywords.items())),
            )
        else:
            # Equal code objects from two modules read different globals.
            self._globals = fn.__globals__
            defaults, kwdefaults, closure = fn.__defaults__, fn.__kwdefaults__, fn.__closure__
            parts = (
                fn.__code__,
                () if defaults is None else tuple(map(_captured_key, defaults)),
                ()
                if kwdefaults is None
                else tuple(sorted((k, _captured_key(v)) for k, v in kwdefaults.items())),
                () if closure is None else tuple(_captured_key(_cell_value(c)) for c in closure),
            )
        self._parts = parts
        self._hash = hash((id(self._globals), parts))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _FunctionKey)
            and other._globals is self._globals
            and other._parts == self._parts
        )

    def __hash__(self) -> int:
        return self._hash


_EMPTY_CELL = _Identity(None)


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # A cell whose variable is not assigned yet.
        return _EMPTY_CELL
