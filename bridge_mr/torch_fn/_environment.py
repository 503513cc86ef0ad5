"""The one torchax environment `from_torch` runs torch code in, made strict.

torchax's default environment is lenient where bridge_mr must not be: an op with no JAX lowering
falls back to eager torch (or fails with torchax's own message, far from the user's code), a
plain CPU tensor captured by the user's code silently mixes with traced values when it is a
scalar, random ops draw from a key fixed at environment creation, and batch norm in training
mode drops its running statistics. This module builds one `Environment` (on first use) whose
dispatch refuses those cases with errors that name the op and the user's source line, and
overrides the ops whose torchax lowering differs from torch's (`aten.detach` keeps
gradients there; batch norm's running statistics are not written back, and torch updates
`running_var` with the unbiased variance; `bernoulli.p` is boolean there; `gather` fails on
values sharded over an Explicit mesh; more in `_lowerings`). `_aliases` makes writes through
views reach their base, and `out=` of a tensor made inside is written as torch writes it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.utils import _pytree as torch_pytree

from bridge_mr._compat import torch as torch_compat
from bridge_mr._compat import torchax as torchax_compat

from . import _aliases, _lowerings, _packed, _recurrent

__all__ = [
    "UnsupportedTorchOperation",
    "environment",
    "keyed",
    "traceable",
    "user_line",
]

_aten = torch.ops.aten


class UnsupportedTorchOperation(NotImplementedError):
    """torch code given to `bridge_mr.from_torch` did something its JAX lowering cannot do.

    Raised while tracing: an op with no JAX lowering, a tensor the function did not receive
    (captured from outside) mixed with its traced values, a random op without a key, or an
    in-place write to an argument not marked mutable. The message names the op and the user's
    source line, and says what to do instead. Not a TypeError: torch turns a TypeError raised
    inside a tensor operator (`x * y`) into NotImplemented, which would hide the message.

    Example:
      >>> def double_(x):  # torch code that writes to its argument
      ...     return x.mul_(2).sum()
      >>> bridge_mr.from_torch(double_)(jnp.ones(2))
      Traceback (most recent call last):
      ...
      bridge_mr...UnsupportedTorchOperation: from_torch(double_) wrote in place to its argument
      [0]; a JAX function cannot hand the new value back unless asked to ... Fix: convert with
      mutable=0 ...
    """


def user_line() -> str:
    """The innermost frame of the caller's stack outside torch, torchax, jax and bridge_mr."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{frame.filename}:{frame.lineno} ({frame.name}: {frame.line})"
    return "<unknown>"


def _library_dirs(tx: torchax_compat.Torchax) -> tuple[str, ...]:
    roots = [os.path.dirname(m.__file__ or "") for m in (torch, jax)]
    roots.append(tx.directory)
    roots.append(os.path.dirname(os.path.dirname(__file__)))  # bridge_mr itself
    roots.append(os.path.dirname(contextlib.__file__ or ""))  # the standard library
    return tuple(os.path.join(root, "") for root in roots)


_LIBRARY_DIRS: tuple[str, ...] = ()

_KEYED = threading.local()  # .depth: how many `keyed` blocks are open in this thread


@contextlib.contextmanager
def keyed(key: jax.Array) -> Iterator[None]:
    """Random ops of the torch code run inside draw from `key` (split once per op)."""
    env = environment()
    depth = getattr(_KEYED, "depth", 0)
    _KEYED.depth = depth + 1
    try:
        with env.override_property(prng=key):
            yield
    finally:
        _KEYED.depth = depth


_CREATE_LOCK = threading.Lock()
_ENVIRONMENT: list[Any] = []  # the strict environment, once built


def environment() -> Any:
    """The strict torchax `Environment` (built once; torchax imported on first call).

    Raises:
      ImportError: torchax is missing or not the pinned version.
    """
    if _ENVIRONMENT:
        return _ENVIRONMENT[0]
    global _LIBRARY_DIRS
    with _CREATE_LOCK:
        if _ENVIRONMENT:
            return _ENVIRONMENT[0]
        tx = torchax_compat.import_torchax()
        _LIBRARY_DIRS = _library_dirs(tx)
        env = tx.Environment()
        # A CPU scalar tensor the function captured would become a constant of the trace.
        env.config.allow_mixed_math_with_scalar_tensor = False
        # Innermost: writes through views (copies in torchax) reach their base.
        _aliases.install(env, UnsupportedTorchOperation, user_line)
        env.dispatch = functools.partial(_strict_dispatch, tx, env.dispatch)
        # torchax's own Python methods (`Tensor.__setitem__`: `out[1] = x` into a tensor made
        # inside) read their arguments' JAX values here: functionalization's wrappers give the
        # values they hold (this environment's attribute only, not torchax's class).
        env.t2j_iso = functools.partial(_values_held, env.t2j_iso)
        env.get_and_rotate_prng_key = functools.partial(_next_key, env)
        torchax_compat.own_every_factory(env)  # every value inside is JAX's (see _move)
        env.override_op_definition(_aten.detach.default, _detach)
        env.override_op_definition(_aten.bernoulli.p, _bernoulli)
        env.override_op_definition(_aten.gather.default, _gather)
        env.override_op_definition(_aten._native_batch_norm_legit.default, _batch_norm_legit)
        env.override_op_definition(_aten.native_batch_norm.default, _batch_norm_legit)
        env.override_op_definition(
            _aten._native_batch_norm_legit_functional.default, _batch_norm_functional
        )
        _lowerings.install(env)  # embedding_bag, multilabel_margin_loss
        # nn.LSTM / GRU / RNN as scans over time (outermost: above functionalization's wrappers).
        _recurrent.install(env, UnsupportedTorchOperation, user_line)
        _ENVIRONMENT.append(env)
        return env


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if torch_compat.is_op_overload(func):
        return f"torch.ops.{func.namespace}.{name}"
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module and not name.startswith(module) else name


#: Python's in-place operators on tensors (`out[:, 2:] += x`).
_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
) | {"__setitem__"}


def _writes_into_own(
    tx: torchax_compat.Torchax, func: Any, args: Any, tensors: Sequence[torch.Tensor]
) -> bool:
    """Whether `func` writes in place into a torchax tensor of the function's own (not a
    functionalization wrapper), from functionalization's wrappers (among the call's
    `tensors`)."""
    if not args or not isinstance(args[0], (tx.Tensor, tx.View)):
        return False
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.startswith("_")  # add_, copy_, index_put_
    if not (in_place or name in _IN_PLACE_OPERATORS):
        return False
    return any(torch_compat.is_functional_tensor(t) for t in tensors)


def _into_out(tx: torchax_compat.Torchax, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """`func(*args, **kwargs)` whose `out=` is a tensor of the function's own (`torch.cat(xs,
    out=buffer)`): computed without it, then written into it (resized where torch resizes)."""
    out = kwargs["out"]
    result = _packed.inner(func(*args, **{k: v for k, v in kwargs.items() if k != "out"}))
    if isinstance(out, tx.Tensor) and out.shape != result.shape:
        dtype = torchax_compat.value_of(out).dtype
        torchax_compat.rebind(out, torchax_compat.value_of(result).astype(dtype))
    else:
        out.copy_(result)
    return out


def _values_held(t2j_iso: Any, tensors: Any) -> Any:
    """torchax's `t2j_iso` (tensors to JAX values), functionalization's wrappers unwrapped."""
    return t2j_iso(_unwrapped(tensors))


def _unwrapped(tree: Any) -> Any:
    """`tree` with each functionalization wrapper replaced by the torchax tensor it holds."""
    return torch_pytree.tree_map_only(torch.Tensor, _packed.inner, tree)


def _strict_dispatch(
    tx: torchax_compat.Torchax,
    dispatch: Any,
    func: Any,
    types: Any,
    args: Any,
    kwargs: Any = None,
) -> Any:
    """torchax's dispatch, refusing what it would run in eager torch or get wrong silently."""
    aten = torch_compat.is_op_overload(func)
    tensors = [
        leaf for leaf in torch_pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
    ]
    # Above the ATen ops, functionalization's wrappers hold the traced values.
    foreign = [
        t
        for t in tensors
        if not isinstance(t, (tx.Tensor, tx.View)) and not torch_compat.is_functional_tensor(t)
    ]
    if foreign and len(foreign) < len(tensors):
        t = foreign[0]
        if t.device.type == "meta":
            raise UnsupportedTorchOperation(
                f"{_op_name(func)} at {user_line()} mixes a meta torch tensor of shape "
                f"{tuple(t.shape)}, made inside the function, with the values it traces: "
                f"bridge_mr.from_torch created that tensor on torch's meta device instead of as "
                f"a JAX value. This is a gap in bridge_mr, not a mistake in your code; please "
                f"report it with this message. Workaround: create the tensor with an explicit "
                f"torch factory (torch.zeros, torch.arange, torch.tensor, ...) instead."
            )
        raise UnsupportedTorchOperation(
            f"{_op_name(func)} at {user_line()} mixes a {t.device.type} torch tensor of shape "
            f"{tuple(t.shape)} that the function did not receive as an argument with the values "
            f"it traces. bridge_mr.from_torch runs the function on JAX values: every tensor it "
            f"computes with must come in through its arguments or be created inside it. Fix: "
            f"pass the tensor in (for a module's parameters and buffers: "
            f"torch.func.functional_call(model, params_and_buffers, args)), or create it "
            f"inside the function."
        )
    if func in _DEVICE_MOVES:
        return traceable(_move(func, args, kwargs or {}))
    if kwargs and kwargs.get("device") is not None:
        # Every value inside is JAX's: a device taken from a traced tensor (a functionalization
        # wrapper reports "meta"), "cpu" or "cuda" all mean a JAX value.
        kwargs = {**kwargs, "device": torchax_compat.device()}
    if func is torch.Tensor.new_tensor:
        # torch's own makes a CPU tensor and moves it to its argument's device (meta, above).
        data = args[1] if len(args) > 1 else (kwargs or {})["data"]
        dtype = (kwargs or {}).get("dtype") or args[0].dtype
        return _strict_dispatch(
            tx,
            dispatch,
            torch.tensor,
            (),
            (data,),
            {"dtype": dtype, "device": torchax_compat.device()},
        )
    if not aten and kwargs and isinstance(kwargs.get("out"), (tx.Tensor, tx.View)):
        return _into_out(tx, func, args, kwargs)
    if not aten and _writes_into_own(tx, func, args, tensors):
        # A write into a tensor made inside the function (`out = torch.zeros(3, 5); out[1] = x`):
        # torchax made it a JAX value of its own, outside functionalization, and torch refuses
        # to write functionalization's wrappers into it. Write the values they hold: the
        # result is the same JAX computation.
        held_args, held_kwargs = torch_pytree.tree_map_only(
            torch.Tensor, _packed.inner, (args, kwargs)
        )
        try:
            return dispatch(func, types, held_args, held_kwargs)
        except tx.OperatorNotFound:  # No Python-level lowering: its ATen ops, on the values.
            return func(*held_args, **(held_kwargs or {}))
    if not aten and any(torch_compat.is_functional_tensor(t) for t in tensors):
        # Functionalization's wrappers report the meta device and hold no values: torchax's own
        # handling of a Python-level function (`Tensor.to` copies its argument's storage) would
        # read them. Run the function itself: it reaches torchax again as ATen ops, unwrapped.
        return traceable(func(*args, **(kwargs or {})))
    try:
        if tensors:
            result = dispatch(func, types, args, kwargs)
        else:
            with warnings.catch_warnings():
                # A factory's int64 is torch's default integer dtype (torch.arange(n),
                # torch.tensor(3)), not a request: integers are 32-bit inside while x64 is off.
                warnings.filterwarnings("ignore", _INT64_TRUNCATED, UserWarning)
                result = dispatch(func, types, args, kwargs)
    except jax.errors.ConcretizationTypeError as error:
        raise UnsupportedTorchOperation(
            f"{_op_name(func)} at {user_line()} reads a traced value as a Python number or "
            f"bool (.item(), bool(tensor), `if tensor:`, int(tensor), .tolist()). Inside "
            f"bridge_mr.from_torch under jax.jit, grad, vmap or map_reduce, a value computed "
            f"from the function's arguments is known only when the compiled program runs, so "
            f"Python code cannot branch on it. Fix: express the choice with tensor ops "
            f"(torch.where, masking) instead of Python control flow; in library code, pick the "
            f"option that avoids this path (for transformers, pass the attention mask as a "
            f"4-D float mask or choose another attn_implementation); or compute the value "
            f"outside the converted function and pass it in as a Python number."
        ) from error
    except tx.OperatorNotFound:
        if not aten:
            raise  # torchax decomposes a Python-level function into ATen ops next.
        raise UnsupportedTorchOperation(
            f"{_op_name(func)} (called at {user_line()}) is unsupported in the JAX lowering of "
            f"torch (torchax {tx.version} has no lowering for it), so bridge_mr.from_torch "
            f"cannot trace this function; it never falls back to eager torch. Fix: express it "
            f"with other torch ops, or compute that part in JAX around the converted function."
        ) from None
    if not torch.is_grad_enabled():
        result = _without_gradient(tx, result)
    return result


_INT64_TRUNCATED = "Explicitly requested dtype int64 requested in .* is not available"


class _JaxValue:
    """`tensor.jax()` for a functionalization wrapper: the JAX value it holds, as torchax's own
    tensors answer. Libraries detect JAX tracing by calling it (transformers' `is_tracing`
    takes its fast paths, which read values with `.item()`, only when the answer is no tracer).
    Holds the wrapper weakly: it is stored on the wrapper itself."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = weakref.ref(tensor)

    def __call__(self) -> Any:
        tensor = self._tensor()
        if tensor is None:
            raise ReferenceError("the tensor of this .jax() is gone")
        inner: Any = torch_compat.functional_inner(tensor)
        tx = torchax_compat.import_torchax()
        if isinstance(inner, tx.View):
            inner = inner.torch()
        return torchax_compat.value_of(inner)


def traceable(tree: Any) -> Any:
    """Gives each functionalization wrapper in `tree` a `.jax()` (see `_JaxValue`); returns it."""
    for leaf in torch_pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and torch_compat.is_functional_tensor(leaf):
            leaf.jax = _JaxValue(leaf)  # pyright: ignore[reportAttributeAccessIssue]
    return tree


#: Device moves: inside `from_torch` every value is JAX's, so a move keeps only its dtype part.
_DEVICE_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda})


def _move(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """`Tensor.to` / `.cpu()` / `.cuda()` as a dtype conversion only (the device stays JAX's)."""
    tensor, *rest = args
    dtype = kwargs.get("dtype")
    if func is torch.Tensor.to:
        for arg in rest:
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, torch.Tensor):
                dtype = arg.dtype
    return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)


def _without_gradient(tx: torchax_compat.Torchax, result: Any) -> Any:
    """What torch.no_grad means for values computed inside it: no gradient flows through."""

    def stop(tensor: Any) -> Any:
        torchax_compat.rebind(tensor, jax.lax.stop_gradient(torchax_compat.value_of(tensor)))
        return tensor

    return torch_pytree.tree_map_only(tx.Tensor, stop, result)


def _next_key(env: Any, generator: torch.Generator | None = None) -> jax.Array:
    """The key a random op draws from: the caller's (`keyed`), split once per op."""
    if generator is not None:
        raise UnsupportedTorchOperation(
            f"a random op at {user_line()} was given generator=; inside bridge_mr.from_torch "
            f"randomness comes from the JAX key the converted function receives, so a torch "
            f"Generator (whose seed would be baked into the trace as a constant) is not "
            f"supported. Fix: drop the generator= argument."
        )
    if not getattr(_KEYED, "depth", 0):
        raise UnsupportedTorchOperation(
            f"the function draws random numbers (at {user_line()}), but it was converted "
            f"without a key: torch.manual_seed and torch's generators do not reach inside "
            f"bridge_mr.from_torch. Fix: convert with bridge_mr.from_torch(fn, rng=True) and "
            f"pass a JAX key (jax.random.key(seed), or a row of bridge_mr.client_keys(...)) "
            f"as the converted function's first argument; or put dropout and other random "
            f"layers in eval mode."
        )
    return env.param.get_and_rotate_prng_key()


def _bernoulli(tensor: Any, p: float = 0.5, *, generator: Any = None) -> Any:
    """`aten.bernoulli.p` in the input's dtype, as torch gives it (torchax's is boolean)."""
    tx = torchax_compat.import_torchax()
    env = environment()
    x = torchax_compat.value_of(tensor)
    draws = jax.random.uniform(env.get_and_rotate_prng_key(generator), x.shape) < p
    return tx.Tensor(draws.astype(x.dtype), env)


def _gather(tensor: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    """`aten.gather` as `take_along_axis`: torchax's fancy indexing fails on values sharded over
    an Explicit mesh axis (cross-entropy's gather, under `map_reduce(..., mesh=...)`)."""
    del sparse_grad  # A hint about torch's backward; JAX's gradient is dense either way.
    tx = torchax_compat.import_torchax()
    x, i = torchax_compat.value_of(tensor), torchax_compat.value_of(index)
    if x.ndim == 0:
        return tx.Tensor(jnp.broadcast_to(x, i.shape), environment())
    if (
        not -x.ndim <= dim < x.ndim
        or i.ndim != x.ndim
        or any(
            n > m
            for d, (n, m) in enumerate(zip(i.shape, x.shape, strict=True))
            if d != dim % x.ndim
        )
    ):
        raise UnsupportedTorchOperation(
            f"torch.gather at {user_line()}: expected dim in [-{x.ndim}, {x.ndim}) and an index "
            f"of {x.ndim} dimensions no larger than the input's outside dim, got dim={dim}, "
            f"input shape {tuple(x.shape)}, index shape {tuple(i.shape)} (torch raises here too)."
        )
    dim = dim % x.ndim
    # torch reads only the leading index.shape[d] entries of the other dimensions.
    x = x[tuple(slice(None) if d == dim else slice(0, n) for d, n in enumerate(i.shape))]
    return tx.Tensor(jnp.take_along_axis(x, i, axis=dim), environment())


def _detach(tensor: Any) -> Any:
    """`aten.detach`: torchax's lowering is the identity, which lets gradients through."""
    tx = torchax_compat.import_torchax()
    return tx.Tensor(jax.lax.stop_gradient(torchax_compat.value_of(tensor)), environment())


def _batch_norm_legit(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Any, Any, Any]:
    """Batch norm as torch computes it, running statistics written back in training mode.

    Returns (output, saved mean, saved inverse std), as `aten._native_batch_norm_legit`.
    """
    tx = torchax_compat.import_torchax()
    env = environment()
    x = torchax_compat.value_of(input)
    axes = (0, *range(2, x.ndim))
    channels = (1, -1) + (1,) * (x.ndim - 2)
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.var(x, axis=axes)
        count = x.size // x.shape[1]
        for stat, batch_value in (
            (running_mean, mean),
            (running_var, var * (count / max(count - 1, 1))),
        ):
            if stat is not None:
                old = torchax_compat.value_of(stat)
                new = (1 - momentum) * old + momentum * jax.lax.stop_gradient(batch_value)
                torchax_compat.rebind(stat, new.astype(old.dtype))
    else:
        mean = torchax_compat.value_of(running_mean)
        var = torchax_compat.value_of(running_var)
    rstd = jax.lax.rsqrt(var + eps)
    out = (x - mean.reshape(channels)) * rstd.reshape(channels)
    if weight is not None:
        out = out * torchax_compat.value_of(weight).reshape(channels)
    if bias is not None:
        out = out + torchax_compat.value_of(bias).reshape(channels)
    saved_mean, saved_rstd = (mean, rstd) if training else (jnp.zeros((0,), x.dtype),) * 2
    return tx.Tensor(out, env), tx.Tensor(saved_mean, env), tx.Tensor(saved_rstd, env)


def _batch_norm_functional(
    input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, *options: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """`aten._native_batch_norm_legit_functional`, what functionalization makes of batch norm.

    `options` are (training, momentum, eps), as `_batch_norm_legit` takes them; the running
    statistics are written to copies, which are returned.

    Returns (output, saved mean, saved inverse std, new running mean, new running var).
    """
    tx = torchax_compat.import_torchax()
    env = environment()
    mean, var = (tx.Tensor(torchax_compat.value_of(s), env) for s in (running_mean, running_var))
    out = _batch_norm_legit(input, weight, bias, mean, var, *options)
    return (*out, mean, var)
