"""The torch.compile path: calls of a compilable torch function as one `torch.library` custom op.

The op `bridge_mr::call_jax(Tensor[] tensors, str target) -> (Tensor[], Tensor[])` names what
to run in `target`:

  "F<uid>"                    forward only;
  "R<uid>:<mask>"             forward that also returns what backward needs (gradients of a
                              scalar output, or VJP residuals), `mask` marking with "1" the
                              tensors that need gradients;
  "B<uid>:<mask>:<inputs>"    the VJP of that forward, on cotangents and residuals; `inputs`
                              spells the forward's input shapes and dtypes.

A target says everything needed to rebuild its traced call, so the traced calls behind compiled
graphs can be evicted (the cache is bounded) and cleared. Its fake implementation takes output
shapes and dtypes from the JAX trace (no data needed), so `torch.compile(fullgraph=True)` can
trace through it; its autograd formula saves the residual tensors and calls the "B" target
(or scales the saved gradients).
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
import torch

from bridge_mr import _caches, runners
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import Aval, torch_dtype
from bridge_mr.dlpack import tensor_avals

from ._autograd import fill_cotangents, scale_gradients, scatter
from ._traced import TracedCall, forward_runner, residual_runner

_OP = "bridge_mr::call_jax"
_MAX_ENTRIES = 256


class OpFunction(Protocol):
    """What the op needs of a compilable torch function: a way to trace one signature."""

    def trace_op(
        self, in_avals: tuple[Aval, ...], device_type: str, diff: tuple[int, ...]
    ) -> TracedCall: ...


_uids = itertools.count()
# The functions by uid: what targets name, not a cache (compiled graphs hold targets, so
# clearing keeps it; an entry lives as long as its function).
_functions: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.RLock()


# The traced calls of the op by target, least recently used out first;
# `bridge_mr.clear_caches()` empties it (compiled graphs rebuild theirs from their targets).
_entries: _caches.Bounded[tuple[str, str, str], _OpEntry] = _caches.register(
    "custom op traced calls", _caches.Bounded(_MAX_ENTRIES)
)


def register(fn: OpFunction) -> str:
    """Defines the custom op (once) and returns the uid by which targets name `fn`.

    A string, not an int: torch.compile treats int attributes that differ between recompiles
    as symbolic, and a target must be a constant.
    """
    _define_op()
    uid = next(_uids)
    _functions[uid] = fn
    return str(uid)


def call(fn: Any, uid: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls compilable `fn` (registered as `uid`) on positional tensors through the custom op."""
    if kwargs:
        raise TypeError(
            f"{fn!r} is compilable, so it takes tensors as positional arguments only; got "
            f"keyword arguments {sorted(kwargs)}. Bind static values with functools.partial "
            "before torch_function(..., compilable=True), or pass them as tensors."
        )
    for i, arg in enumerate(args):
        if isinstance(arg, jax.Array):
            raise TypeError(
                f"{fn!r} is compilable (a torch.library custom op, whose arguments are tensors "
                f"only); argument {i} is a jax.Array of shape {tuple(arg.shape)}. Use "
                "torch_function(..., compilable=False), which takes JAX array inputs, or pass "
                "a torch tensor (bridge_mr.dlpack.to_torch)."
            )
        if not isinstance(arg, torch.Tensor):
            raise TypeError(
                f"{fn!r} is compilable, so it takes tensors as positional arguments only; "
                f"argument {i} is a {type(arg).__name__}. Bind static values with "
                "functools.partial, or use torch_function(..., compilable=False) for pytrees."
            )
    if torch_compat.functorch_transforms_active():
        raise NotImplementedError(
            f"{fn!r} is compilable (a torch.library custom op), and torch.func transforms "
            "(grad, vjp, jvp, vmap, ...) do not see through it. Under torch.func, use "
            "torch_function(jax_fn) without compilable=True, which supports grad, vjp and jvp; "
            "for vmap, batch inside JAX (jax.vmap or map_fn)."
        )
    tensors = list(args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        mask = "".join("1" if t.requires_grad else "0" for t in tensors)
        target = f"R{uid}:{mask}"
    else:
        target = f"F{uid}"
    outputs, _ = torch.ops.bridge_mr.call_jax(tensors, target)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _OpEntry:
    """One traced signature of the op and its runners (built at first real execution)."""

    def __init__(self, traced: TracedCall) -> None:
        self.traced = traced
        self._runners: tuple[runners.Runner, runners.Runner | None] | None = None
        self._lock = threading.Lock()

    def runners(self) -> tuple[runners.Runner, runners.Runner | None]:
        """The forward runner (outputs, then gradients or residuals) and the VJP runner.

        The VJP runner is None for a fused (scalar-output) entry or one without gradients.
        """
        if self._runners is None:
            with self._lock:
                if self._runners is None:
                    traced = self.traced
                    spec = traced.spec
                    names = [f"{spec.name}: tensor {i}" for i in range(len(spec.in_avals))]
                    forward = forward_runner(traced, names, with_extras=True)
                    backward = None
                    if spec.diff and not traced.outputs.fused:
                        backward = residual_runner(traced, residuals_as_tensors=True)
                    self._runners = (forward, backward)
        return self._runners


def _spell(avals: Sequence[Aval]) -> str:
    """Input shapes and dtypes as target text ("float32:2x3;int32:")."""
    return ";".join(f"{dtype.name}:{'x'.join(map(str, shape))}" for shape, dtype in avals)


def _parse(spelled: str) -> tuple[Aval, ...]:
    if not spelled:
        return ()
    avals = []
    for part in spelled.split(";"):
        name, _, dims = part.partition(":")
        avals.append((tuple(int(d) for d in dims.split("x")) if dims else (), np.dtype(name)))
    return tuple(avals)


def _in_avals(fn: Any, tensors: Sequence[torch.Tensor]) -> tuple[Aval, ...]:
    for i, tensor in enumerate(tensors):
        if not all(isinstance(d, int) for d in tensor.shape):
            raise TypeError(
                f"{fn!r}: tensor {i} has a symbolic shape {tuple(tensor.shape)}; a JAX program "
                "is compiled for fixed shapes. Compile with torch.compile(..., dynamic=False), "
                "or mark the dimension static with torch._dynamo.mark_static."
            )
    return tensor_avals(tensors, [f"{fn!r}: tensor {i}" for i in range(len(tensors))])


def _entry(uid: str, mask: str, in_avals: tuple[Aval, ...], device_type: str) -> _OpEntry:
    key = (uid, mask, _spell(in_avals) + "@" + device_type)
    entry = _entries.use(key)
    if entry is not None:
        return entry
    fn = _functions.get(int(uid))
    if fn is None:
        raise RuntimeError(
            f"bridge_mr: a compiled graph calls the compilable torch function #{uid}, which has "
            "been garbage-collected. Keep the function (the torch_function(...) object) alive "
            "as long as graphs compiled with it run."
        )
    traced = fn.trace_op(in_avals, device_type, tuple(i for i, c in enumerate(mask) if c == "1"))
    tree = traced.outputs.tree
    flat = jax.tree_util.treedef_is_leaf(tree) or (
        tree.num_nodes == tree.num_leaves + 1 and tree.node_data()[0] in (tuple, list)
    )
    if not flat:
        raise TypeError(
            f"{fn!r} is compilable, so its JAX function must return one array or a flat "
            f"tuple or list of arrays; it returned {tree}. Flatten the result "
            "(e.g. jax.tree_util.tree_leaves) or use torch_function(..., compilable=False)."
        )
    with _lock:
        found = _entries.use(key)
        return found if found is not None else _entries.put(key, _OpEntry(traced))


def _resolve(target: str, tensors: Sequence[torch.Tensor]) -> _OpEntry:
    device_type = tensors[0].device.type if tensors else "cpu"
    kind, rest = target[0], target[1:]
    if kind == "B":
        uid, mask, spelled = rest.split(":", 2)
        return _entry(uid, mask, _parse(spelled), device_type)
    uid, _, mask = rest.partition(":")
    fn = _functions.get(int(uid))
    return _entry(uid, mask, _in_avals(fn, tensors), device_type)


def _impl(
    tensors: list[torch.Tensor], target: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    entry = _resolve(target, tensors)
    forward, backward = entry.runners()
    if target[0] == "B":
        assert backward is not None  # "B" targets are made for unfused entries only
        grads, _ = backward(tensors, ())
        return grads, []
    exported, _ = forward(tensors, ())
    n = entry.traced.outputs.n_out
    return exported[:n], exported[n:]


def _fake(
    tensors: list[torch.Tensor], target: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    traced = _resolve(target, tensors).traced
    device = tensors[0].device if tensors else torch.device("cpu")

    def empty(avals: Sequence[Aval]) -> list[torch.Tensor]:
        return [torch.empty(s, dtype=torch_dtype(d), device=device) for s, d in avals]

    if target[0] == "B":
        return empty(traced.grad_avals), []
    return empty(traced.outputs.avals), empty(traced.extra_avals)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors, target = inputs
    _, extras = output
    entry = _resolve(target, tensors)
    ctx.n_inputs = len(tensors)
    ctx.target = target
    ctx.traced = entry.traced
    ctx.save_for_backward(*extras)


def _backward(
    ctx: Any, grad_outputs: list[torch.Tensor | None], grad_extras: Any
) -> tuple[Any, None]:
    del grad_extras  # Residuals are internal: nothing flows back through them.
    traced: TracedCall = ctx.traced
    name = traced.spec.name
    if ctx.target[0] != "R":
        raise RuntimeError(
            f"{name}: backward through a compilable function's {ctx.target[0]!r} call (its "
            "forward ran without gradients, or this is a second-order backward). "
            "create_graph=True is not supported on the compilable path; use "
            "torch_function(..., compilable=False) for higher-order gradients."
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: backward with create_graph=True is not supported for compilable torch "
            "functions; use torch_function(..., compilable=False) for higher-order gradients."
        )
    extras = list(ctx.saved_tensors)
    cotangents = fill_cotangents(traced.outputs, grad_outputs, extras[0].device)
    if traced.outputs.fused:
        grads = scale_gradients(extras, cotangents[0], skip_unit=False)
    else:
        uid, _, mask = ctx.target[1:].partition(":")
        vjp_target = f"B{uid}:{mask}:{_spell(traced.spec.in_avals)}"
        grads, _ = torch.ops.bridge_mr.call_jax([*cotangents, *extras], vjp_target)
    return scatter(traced.spec.diff, grads, ctx.n_inputs), None


@functools.cache
def _define_op() -> None:
    op = torch.library.custom_op(_OP, mutates_args=())(_impl)
    op.register_fake(_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
