"""Private names of torch that bridge_mr relies on, each behind one accessor.

Checked on torch 2.13.0 (the main test environment) and torch 2.9.0 (the torch-xla one).
Imports torch only.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch._C._dynamo.eval_frame as _eval_frame
import torch._C._functorch as _functorch
import torch._C._nn
import torch.autograd.forward_ad as _forward_ad

__all__ = [
    "autograd_apply",
    "dispatches_to_python",
    "flatten_dense_tensors",
    "float32_matmul_precision",
    "foreach_copy",
    "forward_ad_active",
    "functional_inner",
    "functorch_transforms_active",
    "graph_break",
    "graph_break_resumes",
    "is_functional_tensor",
    "is_op_overload",
    "pad_sequence",
    "tensor_from_capsule",
    "use_count",
    "version_of",
    "writes_first_argument",
]

_Tensor = torch.Tensor
_PRECISION_READ_WARNS = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)
_dispatch_keys = torch._C._dispatch_keys
_PYTHON_KEY = torch._C.DispatchKey.Python
_unwrap_if_dead = _functorch.unwrap_if_dead

#: `torch._C._are_functorch_transforms_active`: whether a `torch.func` transform (vmap, grad,
#: jvp, vjp, ...) is running in this thread. torch 2.9 - 2.13.
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active

#: `torch._C._nn.flatten_dense_tensors`: one new contiguous 1-D tensor holding the given
#: tensors' values one after the other (what `torch.nn.utils.parameters_to_vector` does,
#: without the per-tensor Python loop). torch 2.9 - 2.13.
flatten_dense_tensors: Callable[[list[torch.Tensor]], torch.Tensor] = (
    torch._C._nn.flatten_dense_tensors
)

#: `torch._C._nn.pad_sequence`: what `torch.nn.utils.rnn.pad_sequence` (and `pack_sequence`)
#: calls to pad a list of sequences into one tensor, the function torch function modes see.
#: torch 2.9 - 2.13.
pad_sequence: Callable[..., torch.Tensor] = torch._C._nn.pad_sequence

#: `torch._foreach_copy_`: copies each source tensor into its destination (same shapes; dtypes
#: and devices converted), one dispatcher call for the whole list. torch 2.9 - 2.13.
foreach_copy: Callable[[list[torch.Tensor], list[torch.Tensor]], Any] = torch._foreach_copy_  # pyright: ignore[reportPrivateImportUsage]

#: `torch._C._from_dlpack`: a tensor sharing a DLPack capsule's memory, without the
#: `__dlpack__` protocol negotiation of `torch.from_dlpack`. torch 2.9 - 2.13.
tensor_from_capsule: Callable[[Any], torch.Tensor] = torch._C._from_dlpack


#: `torch._is_functional_tensor`: whether a tensor is a functionalization wrapper (inside
#: `torch.func.functionalize`). torch 2.9 - 2.13.
is_functional_tensor: Callable[[torch.Tensor], bool] = torch._is_functional_tensor  # pyright: ignore[reportPrivateImportUsage]


def functional_inner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a functionalization wrapper holds now, its pending writes applied.

    `torch._sync` then `torch._from_functional_tensor`. torch 2.9 - 2.13.
    """
    torch._sync(tensor)  # pyright: ignore[reportPrivateImportUsage]
    return torch._from_functional_tensor(tensor)  # pyright: ignore[reportPrivateImportUsage]


def is_op_overload(func: Any) -> bool:
    """Whether `func` is one overload of a dispatcher op (`torch.ops.aten.add.Tensor`), as
    `__torch_dispatch__` sees it, rather than a Python-level function (`torch.add`).
    `torch._ops.OpOverload`, torch 2.9 - 2.13."""
    return isinstance(func, torch._ops.OpOverload)


def writes_first_argument(func: Any) -> bool:
    """Whether `func` is one overload of a dispatcher op that writes into its first argument
    (`aten.copy_`, `aten.fill_.Scalar`, `aten.add_.Tensor`): the argument's alias annotation in
    the op's schema (`Tensor(a!) self`), read from `OpOverload._schema`. torch 2.9 - 2.13."""
    if not isinstance(func, torch._ops.OpOverload) or not func._schema.arguments:
        return False
    alias = func._schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def use_count(tensor: torch.Tensor) -> int:
    """How many references hold `tensor`'s TensorImpl (its Python object, DLPack capsules, other
    tensors' views do not count): torch's private `Tensor._use_count()`, torch 2.9 - 2.13."""
    return int(tensor._use_count())  # pyright: ignore[reportAttributeAccessIssue]


def dispatches_to_python(tensor: torch.Tensor) -> bool:
    """Whether a torch tensor is a `__torch_dispatch__` subclass (e.g. a wrapper subclass).

    Such a tensor's ops run Python code, and its storage need not hold its values (a wrapper
    has none): neither numpy nor DLPack may read its memory. Reads the Python dispatch key
    with `torch._C._dispatch_keys`. torch 2.9 - 2.13.
    """
    if type(tensor) is _Tensor:  # The common case, without the dispatcher query.
        return False
    return bool(_dispatch_keys(tensor).has(_PYTHON_KEY))


def graph_break_resumes() -> bool:
    """Whether Dynamo resumes after `torch._dynamo.graph_break()` (torch 2.13: yes; 2.9: no).

    After such a break torch 2.9 runs the rest of the frame outside Dynamo but still traces its
    callees, so a `torch.compiler.disable`d call that follows is traced (and fails) there.
    """
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


#: Dynamo's frame callback now: None in plain eager code, False where Dynamo runs compiled code
#: only; else set while `torch.compile` runs a frame, also one it runs eagerly because it skips
#: that frame's code (after a failed trace), whose callees it would still compile, JAX's too.
#: A C function (`torch._C._dynamo.eval_frame.get_eval_frame_callback`), no Python frame per
#: call; torch 2.9 - 2.13.
eval_frame_callback: Callable[[], Any] = _eval_frame.get_eval_frame_callback


def float32_matmul_precision() -> str:
    """`torch.get_float32_matmul_precision()`, without the warning torch 2.9 gives at each read
    ("Please use the new API settings to control TF32 behavior", which the user's code did not
    cause); torch 2.13 reads it silently, older releases under `warnings.catch_warnings`."""
    if not _PRECISION_READ_WARNS:
        return torch.get_float32_matmul_precision()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use the new API settings", UserWarning)
        return torch.get_float32_matmul_precision()


def graph_break(msg: str) -> None:
    """Ends the graph Dynamo traces at this point, with `msg` as the reason `fullgraph=True` shows.

    `torch._dynamo.graph_break(msg=...)`, read as an attribute: `torch._dynamo` is imported
    whenever Dynamo is tracing, and importing it here would slow `import bridge_mr`. torch 2.13;
    call it only where `graph_break_resumes()`.
    """
    torch._dynamo.graph_break(msg=msg)


#: A tensor's version counter (`Tensor._version`), which in-place writes bump, read by a C
#: accessor (`list(map(version_of, tensors))`: no Python frame per call). torch 2.9 - 2.13.
version_of: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def forward_ad_active() -> bool:
    """Whether a `torch.autograd.forward_ad.dual_level` is open (dual tensors may exist).

    Read from the module's private level counter `_current_level`, which `dual_level`
    maintains. torch 2.9 - 2.13.
    """
    return _forward_ad._current_level >= 0


def autograd_apply(function_cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """A faster `function_cls.apply` for calls made while no functorch transform is active.

    Python's `torch.autograd.Function.apply` binds its arguments with `inspect.signature` on
    every call (for a class with `setup_context`), then, with no functorch transform active,
    unwraps dead functorch wrappers (tensors that escaped a finished `torch.func` transform)
    and calls the C++ `torch._C._FunctionBase.apply`. The returned callable does the last two
    steps only: it takes positional arguments alone (one argument of any type, then tensors
    only, as `JaxCall` takes a call and its tensors), and unwraps each tensor argument with
    `torch._C._functorch.unwrap_if_dead` (a no-op for ordinary tensors), as Python's apply
    does. While a transform is active it calls `function_cls.apply`, which dispatches to
    torch's `custom_function_call`. torch 2.9 - 2.13.

    Args:
      function_cls: a `torch.autograd.Function` subclass.

    Returns:
      A callable taking `function_cls.forward`'s arguments (without `ctx`), positionally: any
      first argument, then tensors.

    Raises:
      TypeError: `function_cls` is not a `torch.autograd.Function` subclass.
    """
    if not (isinstance(function_cls, type) and issubclass(function_cls, torch.autograd.Function)):
        raise TypeError(
            f"autograd_apply(function_cls) expects a torch.autograd.Function subclass, got "
            f"{function_cls!r}. Fix: pass the class itself, e.g. autograd_apply(MyFunction)."
        )
    # torch._C._FunctionBase.apply; torch's stub of `_FunctionBase` declares no `apply`.
    c_apply: Callable[..., Any] = cast(Any, super(torch.autograd.Function, function_cls)).apply
    python_apply = function_cls.apply
    unwrap = _unwrap_if_dead
    tensor = _Tensor
    active = functorch_transforms_active

    def apply(first: Any, *tensors: torch.Tensor) -> Any:
        if active():
            return python_apply(first, *tensors)
        if isinstance(first, tensor):
            first = unwrap(first)
        return c_apply(first, *map(unwrap, tensors))

    apply.__doc__ = f"`{function_cls.__qualname__}.apply` through torch's C++ apply."
    return apply
