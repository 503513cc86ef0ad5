"""Writes through views that functionalization does not see, made to reach their base.

torchax computes a view op (`slice`, `select`, `diagonal`, `as_strided`, `view`, `alias`, ...) as
a new JAX value: its result shares nothing with its input. `from_torch` runs the torch code
functionalized, so the user's in-place writes through views become functional updates before
torchax sees them, but two kinds of writes reach torchax as in-place ATen ops on a view's copy,
and were lost (silently wrong results):

* inside torch's C++ composite functions that functionalization runs whole (its fallback
  unwraps the arguments and runs the composite below it, in-place ops and all): `F.pad(...,
  mode="circular")` fills a new tensor slice by slice (`out.slice(...).copy_(...)`),
  `F.instance_norm` with running statistics writes them through `alias(running_mean).copy_`;
* into tensors the function made itself (`out = torch.zeros(3, 3); out.diagonal().copy_(x)`):
  torchax makes them JAX values of its own, outside functionalization.

Here every torchax tensor a view op makes remembers what it views (`_Alias`: its root, the
tensor no view op made, and how to get from its parent to it). A dispatch that changes such a
tensor's value (any in-place op, ATen or Python-level) writes the new values into the root at the
view's positions (one scatter, so gradients flow as through torch's view); a dispatch that reads a
view whose root changed since reads it again from the root first. The positions are the view op
applied to the parent's positions (`arange` of the root, viewed as the tensor is): constants,
computed once per written view when the program is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr._compat import torch as torch_compat
from bridge_mr._compat import torchax as torchax_compat

__all__ = ["current", "install"]

_aten = torch.ops.aten

#: Whether an op writes into its first argument (one schema read per op).
_writes_first = functools.cache(torch_compat.writes_first_argument)

#: The attribute of a torchax tensor made by a view op that holds its `_Alias`.
_ATTR = "_bridge_mr_alias"


class _Alias:
    """What a torchax tensor made by a view op views: `root`, through `parent` and `func`."""

    __slots__ = ("args", "func", "item", "kwargs", "parent", "positions", "root", "root_value")

    def __init__(
        self,
        parent: Any,
        root: Any,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        item: int | None,
    ) -> None:
        self.parent, self.root, self.func = parent, root, func
        self.args, self.kwargs, self.item = args, kwargs, item
        self.root_value = torchax_compat.value_of(root)  # the root's value the view was read from
        self.positions: np.ndarray | None = None  # flat positions in the root, once computed


class _Installed:
    """What `install` was given: torchax, its environment, the dispatch it wrapped, and the
    error class and source-line finder for refusals."""

    __slots__ = ("dispatch", "env", "error", "tx", "where")

    def __init__(
        self, env: Any, dispatch: Any, error: type[Exception], where: Callable[[], str]
    ) -> None:
        self.tx = torchax_compat.import_torchax()
        self.env, self.dispatch, self.error, self.where = env, dispatch, error, where


_INSTALLED: list[_Installed] = []  # the one environment's, once installed


def install(env: Any, error: type[Exception], where: Callable[[], str]) -> None:
    """Wraps `env.dispatch` so that writes through views reach their root (module docstring).

    Args:
      env: the torchax `Environment`; install this before any other wrapper of its dispatch,
        so that it sees each call as torchax runs it.
      error: the exception class raised for a write that cannot reach its root.
      where: returns the user's source line, for messages.
    """
    installed = _Installed(env, env.dispatch, error, where)
    _INSTALLED[:] = [installed]
    env.dispatch = functools.partial(_dispatch, installed)
    _own_methods(installed)


def _own_methods(installed: _Installed) -> None:
    """Makes torchax's methods that act without a dispatch act as torch's, for `env`'s tensors.

    torchax 0.0.14's `Tensor.__setitem__` and `View.__setitem__` write without a dispatch (so a
    write into a view's copy would not reach its root), its `Tensor.flatten` returns a copy
    where torch returns a view, its `Tensor.type_as` converts the tensor itself in place where
    torch returns a converted copy, and its `.data = value` does nothing unless `value` is a
    torchax tensor (inside `from_torch` it is mostly functionalization's wrapper of one:
    `nn.utils.vector_to_parameters` left the parameters as they were). Tensors of other
    torchax environments keep torchax's own methods.
    """
    tx, env = installed.tx, installed.env
    tensor_setitem, view_setitem = tx.Tensor.__setitem__, tx.View.__setitem__
    flatten, type_as, data = tx.Tensor.flatten, tx.Tensor.type_as, tx.Tensor.data

    def setitem(original: Callable[..., None]) -> Callable[..., None]:
        def written(self: Any, key: Any, value: Any) -> None:
            if self._env is not env:
                return original(self, key, value)
            return _writing(installed, self, (key, value), lambda: original(self, key, value))

        return written

    def flattened(self: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
        out = flatten(current(self), start_dim, end_dim)
        if self._env is env:
            _track(tx, _aten.view.default, (self, list(out.shape)), {}, out)
        return out

    def converted(self: Any, other: Any) -> Any:
        if self._env is not env:
            return type_as(self, other)
        return self.to(other.dtype)

    def set_data(self: Any, other: Any) -> None:
        held: Any = other
        if isinstance(held, torch.Tensor) and torch_compat.is_functional_tensor(held):
            held = cast(Any, torch_compat.functional_inner(held))
        if isinstance(held, tx.View):
            held = cast(Any, held).torch()
        if self._env is not env or not isinstance(held, tx.Tensor):
            return data.fset(self, other)  # torchax's (its checks, for other tensors)
        # torch gives `self` the other tensor's data: a view of another base from now on.
        torchax_compat.rebind(self, torchax_compat.value_of(current(held)))
        if getattr(self, _ATTR, None) is not None:
            delattr(self, _ATTR)
        return None

    tx.Tensor.data = property(data.fget, set_data)
    tx.Tensor.__setitem__ = setitem(tensor_setitem)
    tx.View.__setitem__ = setitem(view_setitem)
    tx.Tensor.flatten = flattened
    tx.Tensor.type_as = converted


def _writing(installed: _Installed, target: Any, args: Any, write: Callable[[], Any]) -> Any:
    """Runs `target[key] = value` (`write`), as `_dispatch` runs a call: where `target` views
    a root, the elements written (those of `target[key]`, where `key` is of ints and slices;
    else all of `target`) are written into it."""
    tx = installed.tx
    views = _read(tx, (target, args))
    result = write()
    key = args[0]
    for leaf, view, before in views:
        if leaf is target and torchax_compat.value_of(view) is not before:
            _write_back(installed, view, "__setitem__", _region(tx, leaf, key))
    return result


def current(tensor: Any) -> Any:
    """`tensor`, read again from its root first where it is a view whose root has changed."""
    if getattr(tensor, _ATTR, None) is not None:
        _refresh(tensor)
    return tensor


def _dispatch(installed: _Installed, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
    """torchax's dispatch, views read again from their roots before and written back after."""
    tx = installed.tx
    views = _read(tx, (args, kwargs))
    target: Any = args[0] if args else None
    if isinstance(target, tx.View) and _writes_first(func):
        # torchax's in-place ops but copy_ and its table's write into a copy of a lazy View
        # (its decompositions materialize it): write into a copy here and update the View.
        copy = target.torch()
        result = installed.dispatch(func, types, (copy, *args[1:]), kwargs)
        target.update(copy)
        result = target if result is copy else result
    else:
        result = installed.dispatch(func, types, args, kwargs)
    for leaf, view, before in views:
        if torchax_compat.value_of(view) is not before:
            _write_back(installed, view, func, _region(tx, leaf))
    if torch_compat.is_op_overload(func) and func.is_view and args:
        _track(tx, func, args, kwargs or {}, result)
    return result


def _read(tx: torchax_compat.Torchax, tree: Any) -> list[tuple[Any, Any, Any]]:
    """The views among `tree`'s leaves (a view, or a lazy torchax `View` of one), each read
    again from its root where that changed: (leaf, the view, the value it holds now)."""
    views = []
    for leaf in jax.tree_util.tree_leaves(tree):
        source = _source(tx, leaf)
        if source is not None and getattr(source, _ATTR, None) is not None:
            _refresh(source)
            views.append((leaf, source, torchax_compat.value_of(source)))
    return views


def _region(tx: torchax_compat.Torchax, leaf: Any, key: Any = None) -> np.ndarray | None:
    """The flat positions, in the torchax tensor `leaf` holds its value in, of `leaf`'s elements
    (of `leaf[key]` where `key` is given as ints, slices, None and ...); None: all of them."""
    static = key is None or all(
        isinstance(k, (int, slice, type(None), type(Ellipsis)))
        for k in (key if isinstance(key, tuple) else (key,))
    )
    if not isinstance(leaf, tx.View) and (key is None or not static):
        return None
    chain = []
    while isinstance(leaf, tx.View):
        chain.append(leaf.view_info)
        leaf = leaf.parent
    with jax.ensure_compile_time_eval():
        local = jnp.arange(leaf.numel()).reshape(tuple(leaf.shape))
        for info in reversed(chain):
            local = info.transform_tensor(local)
        if key is not None and static:
            local = local[key]
        return np.asarray(local).ravel()


def _source(tx: torchax_compat.Torchax, leaf: Any) -> Any:
    """The torchax tensor `leaf` holds its value in (a lazy torchax `View`'s source), or None."""
    while isinstance(leaf, tx.View):
        leaf = leaf.parent
    return leaf if isinstance(leaf, tx.Tensor) else None


def _root(tx: torchax_compat.Torchax, tensor: Any) -> Any:
    source = _source(tx, tensor)
    alias = getattr(source, _ATTR, None)
    return source if alias is None else alias.root


def _track(
    tx: torchax_compat.Torchax, func: Any, args: Any, kwargs: dict[str, Any], result: Any
) -> None:
    """Marks each torchax tensor `func` (a view op) made as a view of `args[0]`."""
    parent = args[0]
    source = _source(tx, parent)
    if source is None:
        return
    root = _root(tx, parent)
    above: _Alias | None = getattr(source, _ATTR, None)
    listed = isinstance(result, (list, tuple))
    for item, out in enumerate(result if listed else (result,)):
        if not isinstance(out, tx.Tensor) or out is parent or out is root:
            continue
        # A view that reinterprets the dtype (`view(dtype)`, `view_as_real`), or a view of
        # one, has no positions in its root: func None, and a write to it is refused.
        same = out.dtype == parent.dtype and not out.is_complex()
        same = same and (above is None or above.func is not None)
        alias = _Alias(
            parent, root, func if same else None, args[1:], kwargs, item if listed else None
        )
        setattr(out, _ATTR, alias)


def _positions(installed: _Installed, tensor: Any) -> np.ndarray:
    """The flat positions in its root of each element of `tensor` (its shape), as numpy:
    constants, also while `jax.jit` traces."""
    tx = installed.tx
    if isinstance(tensor, tx.View):
        inner = _positions(installed, tensor.parent)
        with jax.ensure_compile_time_eval():
            return np.asarray(tensor.view_info.transform_tensor(jnp.asarray(inner)))
    alias = getattr(tensor, _ATTR, None)
    if alias is None:
        return np.arange(tensor.numel(), dtype=np.int32).reshape(tuple(tensor.shape))
    if alias.positions is None:
        parent = _positions(installed, alias.parent)
        with jax.ensure_compile_time_eval():
            parent = tx.Tensor(jnp.asarray(parent), installed.env)
            viewed = installed.dispatch(alias.func, (), (parent, *alias.args), alias.kwargs)
            if alias.item is not None:
                viewed = viewed[alias.item]
            alias.positions = np.asarray(torchax_compat.value_of(viewed))
    return alias.positions


def _refresh(view: Any) -> None:
    """Reads `view` again from its root where the root changed since it was read."""
    alias: _Alias = getattr(view, _ATTR)
    root_value = torchax_compat.value_of(alias.root)
    if root_value is alias.root_value or alias.func is None:
        return  # unchanged, or a dtype view (refused when written)
    positions = _positions(_INSTALLED[0], view)
    value = jnp.take(jnp.ravel(root_value), jnp.asarray(positions.ravel()))
    torchax_compat.rebind(view, value.reshape(positions.shape))
    alias.root_value = root_value


def _write_back(installed: _Installed, view: Any, func: Any, region: np.ndarray | None) -> None:
    """Writes `view`'s new value (at `region`, flat positions in it; None: all) into its root."""
    alias: _Alias = getattr(view, _ATTR)
    name = getattr(func, "__name__", func)
    if alias.func is None:
        raise installed.error(
            f"{name} at {installed.where()} writes in place into a view that reinterprets its "
            f"base's dtype (view(dtype), view_as_real, .real / .imag): inside "
            f"bridge_mr.from_torch a view is a copy of its base, and this write cannot be "
            f"carried back to it. Fix: compute the new values out of place and build the "
            f"result from them (e.g. torch.complex(real, imag)) instead of writing through "
            f"the view."
        )
    positions = _positions(installed, view).ravel()
    new = jnp.ravel(torchax_compat.value_of(view))
    if region is not None:
        positions, new = positions[region], new[region]
    if np.unique(positions).size != positions.size:
        raise installed.error(
            f"{name} at {installed.where()} writes in place into a view in which several "
            f"elements are one element of its base (an expand, or as_strided with overlapping "
            f"strides); torch raises for such a write too, and bridge_mr.from_torch cannot tell "
            f"which of them holds the value. Fix: write into a copy (.clone()), write one "
            f"row of the expanded view (expanded[0].copy_(...)), or compute the result out of "
            f"place."
        )
    root = alias.root
    old = torchax_compat.value_of(root)
    updated = jnp.ravel(old).at[positions].set(new.astype(old.dtype))
    torchax_compat.rebind(root, updated.reshape(old.shape))
    alias.root_value = torchax_compat.value_of(root)
