"""Runs JAX functions on torch-xla tensors inside torch-xla's lazy graph (the TPU path).

A JAX function is lowered once per input signature to an HLO module and embedded in the
torch-xla graph as a user computation, the same mechanism as
`torch_xla.core.xla_builder.call_jax`, so the JAX computation compiles together with the
surrounding torch ops: no DLPack, no host round trip. Importing this module imports neither
torch_xla nor JAX backends; torch_xla is imported on the first call, when XLA tensors exist.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

__all__ = ["call_jax_on_xla", "is_xla_tensor"]

INSTALL_HINT = "pip install torch==2.9.0 torch_xla==2.9.0"

# Every dtype a torch-xla 2.9 tensor can hold (the others fail at `.to("xla")` already).
_TORCH_TO_JAX_DTYPE: dict[torch.dtype, Any] = {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}

# jax_fn -> {(input signature, jax_enable_x64): embedded computation}. Weak in jax_fn so that
# functions (and whatever they close over) are not kept alive by the cache.
_EMBEDDED: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[Any, ...], Callable[..., Any]]]
_EMBEDDED = weakref.WeakKeyDictionary()


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on a torch-xla device. Never imports torch_xla."""
    return tensor.device.type == "xla"


def call_jax_on_xla(
    jax_fn: Callable[..., Sequence[jax.Array]], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Applies `jax_fn` to XLA tensors as part of torch-xla's lazy graph.

    Args:
      jax_fn: a pure, `jax.jit`-traceable function taking one array per tensor (positionally)
        and returning a flat tuple or list of arrays. The cache is keyed on this object: pass
        the same object on every call (a module-level function, or one built once and kept) so
        that a signature is lowered once and torch-xla compiles its graph once.
      tensors: at least one tensor, all on the XLA device.

    Returns:
      One lazy XLA tensor per output of `jax_fn`. Nothing is executed until torch-xla syncs
      (`torch_xla.sync()`, `.cpu()`, `.item()`, ...). The outputs never require grad: autograd
      belongs to the caller.

    Raises:
      ImportError: torch_xla is not installed.
      ValueError: `tensors` is empty or holds a non-XLA tensor.
      TypeError: a 64-bit tensor while `jax_enable_x64` is off; `jax_fn` does not return a
        flat tuple or list of arrays, or cannot be weakly referenced.
    """
    tensors = list(tensors)
    _check_tensors(tensors)
    signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
    key = (signature, jax.config.jax_enable_x64)
    try:
        per_fn = _EMBEDDED.setdefault(jax_fn, {})
    except TypeError as error:
        raise TypeError(
            f"call_jax_on_xla caches on `jax_fn`, which must be hashable and weakly referenceable; "
            f"got {type(jax_fn).__name__}. Wrap it in a function defined once: "
            f"`def fn(*arrays): return obj(*arrays)`."
        ) from error
    embedded = per_fn.get(key)
    if embedded is None:
        embedded = per_fn[key] = _embed(jax_fn, signature)
    return list(embedded(tensors))


def _check_tensors(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError(
            "call_jax_on_xla needs at least one XLA tensor in `tensors` (it decides the device); "
            "got none."
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"tensors[{index}] must be a torch.Tensor; got {type(tensor).__name__}."
            )
        if not is_xla_tensor(tensor):
            _import_torch_xla()  # A missing torch_xla is the more useful error to report.
            raise ValueError(
                f"tensors[{index}] is on device {tensor.device}, but call_jax_on_xla runs inside "
                f"the torch-xla graph and needs every tensor on the XLA device; move it with "
                f"`tensor.to(torch_xla.device())`."
            )


def _embed(
    jax_fn: Callable[..., Sequence[jax.Array]],
    signature: tuple[tuple[tuple[int, ...], torch.dtype], ...],
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """Lowers `jax_fn` for `signature` and returns torch-xla's callable for the computation."""
    xla_builder, jax_workarounds = _import_torch_xla()
    avals = [jax.ShapeDtypeStruct(shape, _TORCH_TO_JAX_DTYPE[dtype]) for shape, dtype in signature]
    # torch-xla 2.9 partitions with GSPMD and reads GSPMD shardings from the HLO, as its own
    # call_jax does; the flag is restored afterwards so that the user's JAX code is unaffected.
    # jax_env_context is call_jax's guard for JAX starting its backends next to torch-xla's (TPU).
    shardy = jax.config.jax_use_shardy_partitioner
    with jax_workarounds.jax_env_context():
        try:
            jax.config.update("jax_use_shardy_partitioner", False)
            lowered = jax.jit(jax_fn, keep_unused=True).lower(*avals)
            hlo = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
        finally:
            jax.config.update("jax_use_shardy_partitioner", shardy)
    for index, (aval, lowered_aval) in enumerate(zip(avals, lowered.in_avals[0], strict=True)):
        if lowered_aval.dtype != aval.dtype:
            raise TypeError(
                f"tensors[{index}] has dtype {signature[index][1]}, but JAX lowers it as "
                f"{lowered_aval.dtype} because jax_enable_x64 is off; enable it with "
                f"`jax.config.update('jax_enable_x64', True)` or pass a 32-bit tensor."
            )
    leaves = jax.tree.leaves(lowered.out_info)
    if lowered.out_tree not in (jax.tree.structure(tuple(leaves)), jax.tree.structure(leaves)):
        raise TypeError(
            f"jax_fn must return a flat tuple or list of arrays (`return (y,)` for one output); "
            f"it returned the structure {lowered.out_tree}."
        )
    name = "bridge_mr_" + re.sub(r"\W", "_", getattr(jax_fn, "__name__", "jax_fn"))
    computation = xla_builder.computation_from_module_proto(name, hlo)
    return xla_builder.xla_computation_as_func(computation, name)


def _import_torch_xla() -> tuple[Any, Any]:
    try:
        import torch_xla._internal.jax_workarounds as jax_workarounds
        import torch_xla.core.xla_builder as xla_builder
    except ImportError as error:
        raise ImportError(
            f"bridge_mr's torch-xla backend needs torch_xla, which is not importable ({error}). "
            f"Install it with `{INSTALL_HINT}` (torch_xla 2.9.0 requires torch 2.9.0 exactly)."
        ) from error
    return xla_builder, jax_workarounds
