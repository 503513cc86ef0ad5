"""Every key the torch frontend caches by, built here from one context.

A call's `context()` is what, besides its arguments, decides the program it traces: the active
placement, the ambient JAX mesh, JAX's trace context (x64, promotion, precision, the default
device, ...) and torch's float32 matmul precision, which governs programs on an accelerator.
Three keys hold it:

* `call_key`: the full compile key of a `TorchFunction` call (tree structure, each static
  value's key, each tensor's type, shape, dtype, device, layout and `requires_grad`, each JAX
  array input's shape, dtype, weak type and sharding, grad mode);
* `cached_key`: `map_reduce`'s cheaper key of a repeated call (plain tensors and JAX arrays;
  its options as given), under which it keeps the entry the full path found;
* `trace_key`: the key under which a client function's trace is replayed (`_round`).

A test asserts that all three hold `context()`, so no key can miss a part of it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.core
import torch

from bridge_mr import jax_core
from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torch as torch_compat

from ._signature import array_key, is_array
from ._static import FUNCTION_TYPES, FunctionIdentity, function_key, static_key


def context() -> tuple[Any, Any, Any, str]:
    """The active placement, the ambient mesh, JAX's trace context (the default device, x64,
    ...) and torch's float32 matmul precision (`matmul_precision`), as a key's last part."""
    return (
        jax_core.current_placement(),
        jax_core.ambient_mesh(),
        jax_compat.trace_context(),
        torch_compat.float32_matmul_precision(),
    )


#: torch's float32 matmul precision -> JAX's: "highest" float32 products, "high" three
#: bfloat16 passes on a TPU (TF32 on a GPU), "medium" one bfloat16 pass (TF32 on a GPU).
_PRECISIONS = {"highest": "highest", "high": "high", "medium": "default"}


def matmul_precision() -> str:
    """JAX's matmul precision for torch's float32 matmul precision in effect here.

    Returns:
      "highest", "high" or "default" (`jax.default_matmul_precision`'s names).

    Example:
      >>> torch.get_float32_matmul_precision(), matmul_precision()
      ('highest', 'highest')
    """
    return _PRECISIONS[torch_compat.float32_matmul_precision()]


def call_key(
    leaves: Sequence[Any], treedef: Any, grad: bool
) -> tuple[tuple[Any, ...], list[torch.Tensor], list[jax.Array]]:
    """The compile key of a call with these flattened leaves, its tensors and its JAX array
    inputs (`_signature.ArraySlot`), each in order."""
    tensors: list[torch.Tensor] = []
    arrays: list[jax.Array] = []
    # A tensor's or array's signature stands where it sat; a static value's key where it did.
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            parts.append(
                (type(leaf), leaf.shape, leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad)
            )
        elif is_array(leaf):
            arrays.append(leaf)
            parts.append(array_key(leaf))
        else:
            parts.append(static_key(leaf))
    return (treedef, tuple(parts), grad, context()), tensors, arrays


def function_identities(key: tuple[Any, ...]) -> list[FunctionIdentity]:
    """The static functions a `call_key` holds by identity (they could not be keyed by value)."""
    return [part for part in key[1] if isinstance(part, FunctionIdentity)]


def cached_key(
    fn: Any, trees: tuple[Any, ...], options: tuple[Any, ...]
) -> tuple[tuple[Any, ...], list[torch.Tensor], list[jax.Array]] | None:
    """`map_reduce`'s key of a repeated call of `fn` on `trees` (server, clients, weights), the
    call's tensors and its JAX array inputs: `fn`'s key, the tree structure, each tensor's shape,
    dtype, device, layout and `requires_grad`, each JAX array's `array_key`, grad mode, the
    call's options (reduce, placement, mesh, strategy, ...) and `context()`: what `call_key`
    holds for the same call, and what auto's choice depends on. None where a leaf is neither a
    plain torch tensor nor a JAX array (numbers, subclasses) or the trees cannot be flattened
    (dict keys that do not sort): the full path takes them, or names what is wrong."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten(trees)
    except (TypeError, ValueError):
        return None
    parts = []
    tensors: list[torch.Tensor] = []
    arrays: list[jax.Array] = []
    for leaf in leaves:
        if type(leaf) is torch.Tensor:
            tensors.append(leaf)
            parts.append((leaf.shape, leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad))
        elif isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):  # is_array
            arrays.append(leaf)
            parts.append(array_key(leaf))
        else:
            return None
    key = (
        function_key(fn) if isinstance(fn, FUNCTION_TYPES) else static_key(fn),
        treedef,
        tuple(parts),
        torch.is_grad_enabled(),
        options,
        context(),
    )
    return key, tensors, arrays


def by_identity(key: tuple[Any, ...]) -> bool:
    """Whether a `cached_key` holds its function by identity (bounded more tightly)."""
    return isinstance(key[0], FunctionIdentity)


def trace_key(tree: Any, avals: tuple[Any, ...]) -> Hashable:
    """The key of a client function's trace for one client's (tree, avals) (see `_round`)."""
    return (tree, avals, torch.is_grad_enabled(), context())
