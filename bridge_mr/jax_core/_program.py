"""The active placement: `program(placements={"clients": n})` and its context variable."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

import jax
from typing_extensions import ParamSpec

from bridge_mr._compat.jax import DimExpr

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: The size of a placement: a positive int, or a `jax.export` symbolic dimension.
Size: TypeAlias = int | DimExpr


@dataclasses.dataclass(frozen=True)
class Placement:
    """A placement: the name of the placed axis (e.g. "clients") and its size.

    The size is a positive int, or a `jax.export` symbolic dimension (`n` in
    `n, = jax.export.symbolic_shape("n")`) for a program exported once for any count.

    Attributes:
        name: The name of the placed axis, e.g. "clients".
        size: Its size: a positive int or a `jax.export` symbolic dimension.

    Example:
        >>> with bridge_mr.program(placements={"clients": 8}) as placement:
        ...     pass
        >>> placement
        Placement(name='clients', size=8)
        >>> n, = jax.export.symbolic_shape("n")
        >>> bridge_mr.Placement("clients", n).size
        n
    """

    name: str
    size: Size


class BroadcastSources:
    """What `broadcast` placed in one program scope: each placed leaf, by identity, → its input.

    `map_fn` passes a leaf found here into the map unbatched (its input, `vmap` in_axes=None),
    which is the same function of the same values: a placed leaf *is* its input repeated along
    the placement axis, as long as that very object lives (arrays are immutable). The table is
    keyed by `id` and holds a weak reference to the placed leaf, checked with `is` on lookup:
    when the leaf dies its entry goes with it (a weakref callback), so an `id` reused by a later
    object never hits, and a long eager loop inside one `with program(...)` block does not
    accumulate entries. The input is held strongly while its placed leaf lives. The table itself
    lives in the program's scope (the context variable), so it is dropped when the program's
    call or block ends, and threads or tasks tracing other programs have their own.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def record(self, placed: Any, source: Any) -> None:
        """Records that the leaf `placed` is `source` broadcast along the placement axis."""
        key, table = id(placed), weakref.ref(self)

        def forget(ref: weakref.ref[Any]) -> None:
            # Called while `placed` is being freed, before its id can be reused. The weak
            # reference to the table keeps the entry from holding the table in a cycle.
            sources = table()
            if sources is not None and sources._entries.get(key, (None,))[0] is ref:
                sources._entries.pop(key, None)

        self._entries[key] = (weakref.ref(placed, forget), source)

    def source(self, leaf: Any) -> Any | None:
        """The input `leaf` was broadcast from, if `leaf` is a live output of `broadcast`."""
        entry = self._entries.get(id(leaf))
        if entry is None or entry[0]() is not leaf:
            return None
        return entry[1]


@dataclasses.dataclass(frozen=True)
class _Scope:
    """One active `program`: its placement, the broadcasts made under it, whether it keeps maps."""

    placement: Placement
    broadcasts: BroadcastSources
    keep_maps: bool = False


_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "bridge_mr_placement", default=None
)


def _enter_scope(placement: Placement, keep_maps: bool = False) -> contextvars.Token[_Scope | None]:
    """Activates `placement` with a fresh broadcast table (shared with an equal outer placement)."""
    outer = _ACTIVE.get()
    if outer is not None and outer.placement == placement:
        return _ACTIVE.set(_Scope(placement, outer.broadcasts, keep_maps or outer.keep_maps))
    return _ACTIVE.set(_Scope(placement, BroadcastSources(), keep_maps))


def keeps_maps() -> bool:
    """Whether the innermost active program keeps each `map_fn` as one `placed_map`."""
    scope = _ACTIVE.get()
    return scope is not None and scope.keep_maps


def current_placement() -> Placement | None:
    """The placement of the innermost active `program` in this thread or task.

    Returns:
        Its `Placement`, or None outside any program.

    Example:
        >>> bridge_mr.current_placement() is None  # outside any program
        True
        >>> with bridge_mr.program(clients=8):
        ...     inside = bridge_mr.current_placement()
        >>> inside == bridge_mr.Placement("clients", 8)
        True
    """
    scope = _ACTIVE.get()
    return None if scope is None else scope.placement


def require_placement(caller: str) -> Placement:
    """Returns the active placement, or raises a RuntimeError naming `caller` and the fix."""
    return _require_scope(caller).placement


def require_broadcasts(caller: str) -> BroadcastSources:
    """The broadcast table of the active program (a RuntimeError naming `caller` outside one)."""
    return _require_scope(caller).broadcasts


def _require_scope(caller: str) -> _Scope:
    scope = _ACTIVE.get()
    if scope is None:
        raise RuntimeError(
            f"bridge_mr.{caller} was called outside any program: it needs to know the placement "
            "(its name and size). Wrap the code in `with bridge_mr.program(placements="
            '{"clients": n}):` or decorate the function with '
            '`@bridge_mr.program(placements={"clients": n})`.'
        )
    return scope


def _validate_placements(placements: Any) -> Placement:
    if not isinstance(placements, Mapping):
        raise TypeError(
            "program(placements=...) expects a mapping with one entry {name: size}, e.g. "
            f'{{"clients": 8}}; got {type(placements).__name__}: {placements!r}.'
        )
    if len(placements) != 1:
        raise ValueError(
            "program(placements=...) expects exactly one placement {name: size}, e.g. "
            f'{{"clients": 8}}; got {len(placements)} entries: {dict(placements)!r}. '
            "Nest one program per placement if you need several."
        )
    [(name, size)] = placements.items()
    if not isinstance(name, str) or not name:
        raise TypeError(
            "program(placements=...) expects the placement name to be a non-empty str, e.g. "
            f'"clients"; got {type(name).__name__}: {name!r}.'
        )
    return Placement(name, _validate_size(name, size))


def _validate_size(name: str, size: Any) -> Size:
    """Returns `size` as a positive int or a symbolic dimension that is provably >= 1."""
    if jax.export.is_symbolic_dim(size):
        try:
            positive = size >= 1
        except jax.errors.InconclusiveDimensionOperation:
            positive = False
        if not positive:
            raise ValueError(
                f"program(placements=...) expects the size of placement {name!r} to be "
                f"positive; the symbolic size {size} is not >= 1 for every value of its "
                'dimension variables. Use a variable (jax.export.symbolic_shape("n") '
                "assumes n >= 1), an expression that is >= 1 whenever its variables are, or "
                f'declare it: jax.export.symbolic_shape(..., constraints=("{size} >= 1",)).'
            )
        return size
    try:
        size_int = operator.index(size)
    except TypeError:
        size_int = None
    if size_int is None or isinstance(size, bool) or size_int <= 0:
        raise ValueError(
            f"program(placements=...) expects the size of placement {name!r} to be a positive "
            f"int (the number of {name}) or a jax.export symbolic dimension; got "
            f"{type(size).__name__}: {size!r}."
        )
    return size_int


class program:  # Lower-case like a function, as in drjax.
    """Activates a placement for `broadcast`, `map_fn` and the reductions.

    Use as a decorator or as a context manager (see the example). `program(clients=8)` is
    accepted as a shorthand, as in drjax. The placement lives in a context variable: concurrent
    threads can run programs with different placements.

    The size may be a `jax.export` symbolic dimension, to export one program for every
    client count. JAX solves the dimension from the exported function's input shapes, so some
    input must carry it (typically the placed client data).

    Args:
        placements: One entry {name: size}: the placement's name (e.g. "clients") and size, a
            positive int or a symbolic dimension that is >= 1 for all its values.
        keep_maps: Each `map_fn` without a mesh binds one `placed_map` primitive holding its
            per-client function, instead of inlining its vmap, for interpreters of the program
            that split it at `map_fn`'s boundary (`bridge_mr.beam` sets it). `jit` compiles the
            same program either way; differentiation recomputes each map's forward once more.
            An inner program of the same placement inherits it.
        **kwargs: Instead of `placements`, one `name=size` keyword.

    Raises:
        TypeError: `placements` is not a mapping, its name is not a non-empty str, or both
            `placements` and a keyword are given.
        ValueError: Not exactly one placement, or the size is not a positive int (bools,
            floats and strings are refused) nor a symbolic dimension that is always >= 1.

    Example:
        >>> @bridge_mr.program(placements={"clients": 8})  # as a decorator
        ... def round_loss(params, batch):
        ...     losses = bridge_mr.map_fn(jax_loss, (bridge_mr.broadcast(params), batch))
        ...     return bridge_mr.reduce_mean(losses)
        >>> round_loss(params, batch)
        tensor(1., grad_fn=<...>)
        >>> with bridge_mr.program(clients=8):  # as a context manager, with the shorthand
        ...     placed = bridge_mr.broadcast(params)
        >>> placed["w"].shape
        torch.Size([8, 3])

        Exported once for any number of clients (a symbolic size):

        >>> from bridge_mr import jax_core as mr
        >>> n, = jax.export.symbolic_shape("n")
        >>> def total(data):  # data: [n, 3], one row per client
        ...     return mr.reduce_sum(mr.map_fn(jnp.sum, data))
        >>> exported = jax.export.export(jax.jit(bridge_mr.program(clients=n)(total)))(
        ...     jax.ShapeDtypeStruct((n, 3), jnp.float32))
        >>> exported.call(jnp.ones((7, 3)))  # 7 clients
        Array(21., dtype=float32)
        >>> exported.call(jnp.ones((2, 3)))  # 2 clients, the same program
        Array(6., dtype=float32)
    """

    def __init__(
        self,
        placements: Mapping[str, Size] | None = None,
        *,
        keep_maps: bool = False,
        **kwargs: Size,
    ) -> None:
        if not isinstance(keep_maps, bool):
            raise TypeError(
                f"program(keep_maps=...) expects a bool; got {type(keep_maps).__name__}: "
                f"{keep_maps!r}."
            )
        self.keep_maps = keep_maps
        if placements is not None and kwargs:
            raise TypeError(
                "program() takes either placements={name: size} or one keyword name=size, not "
                f"both; got placements={placements!r} and {kwargs!r}."
            )
        self.placement = _validate_placements(kwargs if placements is None else placements)
        self._tokens = threading.local()

    def __repr__(self) -> str:
        keep = ", keep_maps=True" if self.keep_maps else ""
        return f"program(placements={{{self.placement.name!r}: {self.placement.size}}}{keep})"

    def __enter__(self) -> Placement:
        stack = self._tokens.__dict__.setdefault("stack", [])
        stack.append(_enter_scope(self.placement, self.keep_maps))
        return self.placement

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _ACTIVE.reset(self._tokens.stack.pop())

    def __call__(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        if not callable(fn):
            raise TypeError(
                f"{self!r} decorates a callable; got {type(fn).__name__}: {fn!r}. Use it as "
                "`@program(...)` above a function, or as `with program(...):`."
            )
        placement = self.placement
        keep_maps = self.keep_maps

        @functools.wraps(fn)
        def with_placement(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            token = _enter_scope(placement, keep_maps)
            try:
                return fn(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        return with_placement
