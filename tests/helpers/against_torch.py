"""One torch function run by `bridge_mr.from_torch` and by torch itself: values and gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import bridge_mr

# float32 on both sides; the largest difference the probed functions showed is 2e-6 (a circular
# convolution's gradient, sums of 18 products), rounding only.
RTOL, ATOL = 1e-5, 1e-5


def _close(got: Any, want: torch.Tensor, what: str) -> None:
    got = torch.from_numpy(np.array(got))
    torch.testing.assert_close(
        got, want.detach(), rtol=RTOL, atol=ATOL, check_dtype=False, msg=lambda m: f"{what}: {m}"
    )


def check(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    grad: bool = True,
    jit: bool = True,
) -> None:
    """`from_torch(fn)` equals `fn` on `inputs`: the value eager and (with `jit`) under
    `jax.jit`, and (with `grad`) the gradient of `(fn(*inputs) * probe).sum()` in each float
    input, under `jax.jit(jax.grad(...))`, against torch autograd (float32, `RTOL` / `ATOL`).

    Each side gets its own copies of `inputs`.
    """
    want = fn(*[x.clone() for x in inputs])
    converted = bridge_mr.from_torch(fn)
    arrays = [jnp.asarray(x.numpy()) for x in inputs]
    _close(converted(*arrays), want, f"{fn.__name__}: eager value")
    if jit:
        _close(jax.jit(converted)(*arrays), want, f"{fn.__name__}: jitted value")
    if not grad:
        return
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    floats = [i for i, x in enumerate(inputs) if x.is_floating_point()]
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    (fn(*leaves) * probe).sum().backward()
    jprobe = jnp.asarray(probe.numpy())
    grads = jax.jit(jax.grad(lambda *a: (converted(*a) * jprobe).sum(), argnums=tuple(floats)))(
        *arrays
    )
    for i, got in zip(floats, grads, strict=True):
        reference = leaves[i].grad
        _close(
            got,
            torch.zeros_like(leaves[i]) if reference is None else reference,
            f"{fn.__name__}: gradient of input {i}",
        )
