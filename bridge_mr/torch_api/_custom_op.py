"""The torch.compile path: calls of a compilable torch function as one `torch.library` custom op.

The op `bridge_mr::call_jax(Tensor[] tensors, str program) -> (Tensor[], Tensor[])` names what
to run in `program`:

  "F<function uid>"          forward only;
  "R<function uid>:<mask>"   forward that also returns what backward needs (gradients of a
                             scalar output, or VJP residuals), `mask` marking with "1" the
                             tensors that need gradients;
  "B<entry uid>"             the VJP of one traced signature, on cotangents and residuals.

Its fake implementation takes output shapes and dtypes from the JAX trace (no data needed),
so `torch.compile(fullgraph=True)` can trace through it; its autograd formula saves the
residual tensors and calls the "B" program (or scales the saved gradients).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import torch

from bridge_mr import _dtypes
from bridge_mr._compat import torch as _torch_compat

if TYPE_CHECKING:
    from ._function import TorchFunction, _Entry

_OP = "bridge_mr::call_jax"
_uids = itertools.count()
_functions: weakref.WeakValueDictionary[int, TorchFunction] = weakref.WeakValueDictionary()
_entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()


def register_function(fn: TorchFunction) -> str:
    """Defines the custom op (once) and returns the uid by which programs name `fn`.

    A string, not an int: torch.compile treats int attributes that differ between recompiles
    as symbolic, and a program name must be a constant.
    """
    _define_op()
    uid = next(_uids)
    _functions[uid] = fn
    return str(uid)


def register_entry(entry: _Entry) -> int:
    """Returns the uid by which "B" programs name `entry`."""
    uid = next(_uids)
    _entries[uid] = entry
    return uid


def call(fn: TorchFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls compilable `fn` on positional tensors through the custom op."""
    if kwargs:
        raise TypeError(
            f"{fn!r} is compilable, so it takes tensors as positional arguments only; got "
            f"keyword arguments {sorted(kwargs)}. Bind static values with functools.partial "
            "before torch_function(..., compilable=True), or pass them as tensors."
        )
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(
                f"{fn!r} is compilable, so it takes tensors as positional arguments only; "
                f"argument {i} is a {type(arg).__name__}. Bind static values with "
                "functools.partial, or use torch_function(..., compilable=False) for pytrees."
            )
    if _torch_compat.functorch_transforms_active():
        raise NotImplementedError(
            f"{fn!r} is compilable (a torch.library custom op), and torch.func transforms "
            "(grad, vjp, jvp, vmap, ...) do not see through it. Under torch.func, use "
            "torch_function(jax_fn) without compilable=True, which supports grad, vjp and jvp; "
            "for vmap, batch inside JAX (jax.vmap or map_fn)."
        )
    tensors = list(args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        mask = "".join("1" if t.requires_grad else "0" for t in tensors)
        program = f"R{fn.uid}:{mask}"
    else:
        program = f"F{fn.uid}"
    outputs, _ = torch.ops.bridge_mr.call_jax(tensors, program)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _resolve(program: str, tensors: Sequence[torch.Tensor]) -> _Entry:
    kind, rest = program[0], program[1:]
    if kind == "B":
        return _entries[int(rest)]
    uid, _, mask = rest.partition(":")
    fn = _functions[int(uid)]
    for i, tensor in enumerate(tensors):
        if not all(isinstance(d, int) for d in tensor.shape):
            raise TypeError(
                f"{fn!r}: tensor {i} has a symbolic shape {tuple(tensor.shape)}; a JAX program "
                "is compiled for fixed shapes. Compile with torch.compile(..., dynamic=False), "
                "or mark the dimension static with torch._dynamo.mark_static."
            )
    entry = fn.op_entry(tensors, tuple(i for i, c in enumerate(mask) if c == "1"))
    out_def = entry.out_def
    flat = jax.tree_util.treedef_is_leaf(out_def) or (
        out_def.num_nodes == out_def.num_leaves + 1 and out_def.node_data()[0] in (tuple, list)
    )
    if not flat:
        raise TypeError(
            f"{fn!r} is compilable, so its JAX function must return one array or a flat "
            f"tuple or list of arrays; it returned {entry.out_def}. Flatten the result "
            "(e.g. jax.tree_util.tree_leaves) or use torch_function(..., compilable=False)."
        )
    return entry


def _impl(
    tensors: list[torch.Tensor], program: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    entry = _resolve(program, tensors)
    forward, backward = entry.op_runners()
    if program[0] == "B":
        assert backward is not None  # "B" programs are made for unfused entries only
        grads, _ = backward(tensors, ())
        return grads, []
    exported, _ = forward(tensors, ())
    return exported[: entry.n_out], exported[entry.n_out :]


def _fake(
    tensors: list[torch.Tensor], program: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    entry = _resolve(program, tensors)
    device = tensors[0].device if tensors else torch.device("cpu")

    def empty(avals: Sequence[_dtypes.Aval]) -> list[torch.Tensor]:
        return [torch.empty(s, dtype=_dtypes.torch_dtype(d), device=device) for s, d in avals]

    if program[0] == "B":
        return empty([entry.in_avals[i] for i in entry.diff]), []
    return empty(entry.out_avals), empty(entry.extra_avals())


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors, program = inputs
    _, extras = output
    ctx.n_inputs = len(tensors)
    ctx.program = program
    ctx.entry = _resolve(program, tensors)
    ctx.save_for_backward(*extras)


def _backward(
    ctx: Any, grad_outputs: list[torch.Tensor | None], grad_extras: Any
) -> tuple[Any, None]:
    del grad_extras  # Residuals are internal: nothing flows back through them.
    entry: _Entry = ctx.entry
    if ctx.program[0] != "R":
        raise RuntimeError(
            f"{entry.owner!r}: backward through a compilable function's {ctx.program[0]!r} "
            "program (its forward ran without gradients, or this is a second-order backward). "
            "create_graph=True is not supported on the compilable path; use "
            "torch_function(..., compilable=False) for higher-order gradients."
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{entry.owner!r}: backward with create_graph=True is not supported for compilable "
            "torch functions; use torch_function(..., compilable=False) for higher-order "
            "gradients."
        )
    extras = ctx.saved_tensors
    cotangents = []
    for i in entry.float_outputs:
        grad = grad_outputs[i]
        if grad is None:
            shape, dtype = entry.out_avals[i]
            grad = torch.zeros(shape, dtype=_dtypes.torch_dtype(dtype), device=extras[0].device)
        cotangents.append(grad)
    if entry.fused:
        (scale,) = cotangents
        grads = [g * scale.to(g.dtype) for g in extras]
    else:
        grads, _ = torch.ops.bridge_mr.call_jax([*cotangents, *extras], f"B{entry.uid}")
    result: list[Any] = [None] * ctx.n_inputs
    for i, grad in zip(entry.diff, grads, strict=True):
        result[i] = grad
    return result, None


@functools.cache
def _define_op() -> None:
    op = torch.library.custom_op(_OP, mutates_args=())(_impl)
    op.register_fake(_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
