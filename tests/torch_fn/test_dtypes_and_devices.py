"""`bridge_mr.from_torch`: dtypes and devices inside. int64 is int32 while x64 is off (`.long()`
with JAX's warning, float64 numpy refused), `.to(...)` / `.cpu()` convert like torch, and tensors
the torch code creates are JAX values whatever device it names, under every transform and
`map_reduce` strategy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.from_torch import close

import bridge_mr

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


def test_long_inside_computes_in_int32_with_jax_s_warning() -> None:
    fn = bridge_mr.from_torch(lambda logits, y: F.cross_entropy(logits, y.long()))
    logits = torch.randn(4, 3)
    y = torch.tensor([0, 2, 1, 2])
    with pytest.warns(UserWarning, match=r"int64 .* truncated to dtype int32"):
        got = fn(jnp.asarray(logits.numpy()), jnp.asarray(y.numpy().astype(np.int32)))
    close(got, F.cross_entropy(logits, y), "cross_entropy of .long() labels")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_to_a_dtype_a_device_or_a_tensor_converts_like_torch(jit: bool) -> None:
    def fn(x: torch.Tensor) -> Any:
        return (
            x.to(torch.float16).to(torch.float32) * 3,
            x.to("jax") * 3,
            x.to(dtype=torch.int32),
            x.to(x) + 1,
            x.cpu() * 2,
        )

    x = torch.tensor([1.0, 2.5, -3.0])
    converted = bridge_mr.from_torch(fn)
    got = (jax.jit(converted) if jit else converted)(jnp.asarray(x.numpy()))
    expected = (x.half().float() * 3, x * 3, x.int(), x + 1, x * 2)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b.numpy())


def test_numpy_arguments_are_not_taken_for_writes_and_64_bit_ones_are_refused() -> None:
    out = bridge_mr.from_torch(lambda x: x * 2)(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])
    with pytest.raises(TypeError, match=r"float64.*narrow"):
        bridge_mr.from_torch(lambda x: x * 2)(np.arange(3.0))


def _factories(x: torch.Tensor, accelerator: str = "cuda") -> torch.Tensor:
    """Factories as library code writes them: devices of traced tensors, "cpu", "cuda"."""
    h = x * 2  # an intermediate: functionalization's wrapper of it reports the meta device
    out = h + torch.arange(4, device=h.device) + torch.zeros(3, 4, device="cpu")
    out = (
        out + torch.ones(4, device=torch.device("cpu")) + torch.full((4,), 0.5, device=accelerator)
    )
    out = out + h.new_zeros(3, 4) + h.new_full((4,), 1.0) + h.new_ones(4) + h.new_empty(4).fill_(2)
    out = out + h.new_tensor([1.0, 2.0, 3.0, 4.0]) + x.new_tensor(3.0)
    out = out + torch.zeros_like(h, device="cpu") + torch.full_like(h, 2.0) + torch.ones_like(h)
    out = out + torch.tensor(3.0, device=h.device) * torch.eye(4, device=h.device)[0]
    out = out * torch.tensor(2, device=h.device) + torch.linspace(0, 1, 4, device=h.device)
    keep = torch.triu(torch.ones(4, 4, dtype=torch.bool, device=h.device))[1]
    out = torch.where(keep, out, torch.zeros((), device=h.device, dtype=h.dtype))
    scale = torch.arange(4).to(h.device).to(device=h.device, dtype=h.dtype)
    written = torch.zeros(3, 4)  # made inside, then written into (as pad_sequence writes)
    written[1] = h[0]
    written[:, 2:] += h[:, 2:] * 3
    written[2].copy_(h[1]).mul_(2)
    return (out * scale + written).sum(-1)


def _in_torch(x: torch.Tensor) -> torch.Tensor:
    return _factories(x, accelerator="cpu")  # torch itself has no CUDA here


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "scan"])
def test_factories_with_any_device_are_jax_values(transform: str) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    fn = bridge_mr.from_torch(_factories)
    jx = jnp.asarray(x.numpy())
    if transform in ("eager", "jit"):
        got = (jax.jit(fn) if transform == "jit" else fn)(jx)
        close(got, _in_torch(x), "factories")
    elif transform == "grad":
        got = jax.jit(jax.grad(lambda v: fn(v).sum()))(jx)
        close(got, torch.func.grad(lambda v: _in_torch(v).sum())(x), "factories' gradient")
    elif transform == "vmap":
        xs = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
        got = jax.vmap(fn)(jnp.asarray(xs.numpy()))
        close(got, torch.stack([_in_torch(v) for v in xs]), "vmap of factories")
    else:
        xs = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
        _, got = jax.lax.scan(lambda c, v: (c, fn(v)), 0, jnp.asarray(xs.numpy()))
        close(got, torch.stack([_in_torch(v) for v in xs]), "scan of factories")


@pytest.mark.parametrize("strategy", ["vmap", "per_client", "chunks", "auto"])
def test_factories_with_any_device_work_under_every_map_reduce_strategy(strategy: str) -> None:
    w = torch.randn(4, requires_grad=True, generator=torch.Generator().manual_seed(2))
    xs = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(3))
    fn = bridge_mr.from_torch(lambda w, x: (_factories(x * w) ** 2).mean())
    chunks = {"chunk_size": 4} if strategy == "chunks" else {}
    loss = bridge_mr.map_reduce(fn, w, xs, strategy=strategy, **chunks)
    loss.backward()
    reference = w.detach().clone().requires_grad_()
    expected = torch.stack([(_in_torch(x * reference) ** 2).mean() for x in xs]).mean()
    expected.backward()
    close(loss, expected, f"{strategy} loss")
    close(w.grad, reference.grad, f"{strategy} gradient")
