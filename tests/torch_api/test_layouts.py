"""Consecutive calls of one function whose tensors change layout between calls.

A tensor's layout (row-major, permuted-dense such as `w.t()`, strided, at a storage offset,
misaligned) decides how it crosses: a numpy view, a shared column-major array, or a copy. A
program compiled for one layout must never be handed another (compiled programs kept on disk
take only the layouts they were compiled for). Each call, forward and gradients, for every
strategy and with and without the programs on disk, is checked against a float64 torch loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax.numpy as jnp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bridge_mr

_LAYOUTS = ("row-major", "permuted", "strided", "offset", "misaligned")
_STRATEGIES = ("vmap", "per_client", "chunks", "auto")
# Relative tolerances: the client computes in float32 from each input's (rounded) values, so
# the loss is float32-close to a float64 loop over the same values; a gradient comes back in
# its input's dtype.
_DTYPES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _laid_out(values: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A leaf tensor holding `values` (cast to `dtype`) in the given layout."""
    shape = values.shape
    if layout == "row-major":
        tensor = torch.empty(shape, dtype=dtype)
    elif layout == "permuted":  # The dimensions' order reversed: dense, not row-major.
        strides = [0] * len(shape)
        step = 1
        for dim in range(len(shape)):
            strides[dim] = step
            step *= shape[dim]
        tensor = torch.empty_strided(shape, strides, dtype=dtype)
    elif layout == "strided":  # Every other element of the last dimension: not compact.
        tensor = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)[..., ::2]
    elif layout == "offset":  # Compact at a 64-byte aligned storage offset.
        per_line = 64 // torch.empty((), dtype=dtype).element_size()
        tensor = torch.empty(per_line + math.prod(shape), dtype=dtype)[per_line:].view(shape)
    else:  # "misaligned": one element into its storage, not 64-byte aligned.
        tensor = torch.empty(1 + math.prod(shape), dtype=dtype)[1:].view(shape)
    with torch.no_grad():
        tensor.copy_(values)
    return tensor.detach()


def _client(server: dict[str, jnp.ndarray], x: jnp.ndarray) -> jnp.ndarray:
    w, b = server["w"].astype(jnp.float32), server["b"].astype(jnp.float32)
    return jnp.sum(jnp.tanh(x.astype(jnp.float32) @ w) * b)


def _torch_loop(server: dict[str, torch.Tensor], clients: torch.Tensor) -> torch.Tensor:
    losses = [torch.sum(torch.tanh(x @ server["w"]) * server["b"]) for x in clients]
    return torch.stack(losses).mean()


def _check_call(
    strategy: str,
    dtypes: tuple[torch.dtype, ...],
    layouts: tuple[str, ...],
    grad: bool,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    # A float32 `w` is over the size below which same-dtype inputs cross packed in one buffer:
    # it crosses alone, in its own layout. So does any input alone in its dtype.
    w, b = torch.randn(260, 64, generator=g) / 16, torch.randn(64, generator=g)
    x = torch.randn(4, 3, 260, generator=g)
    w, b, x = (_laid_out(v, lay, dt) for v, lay, dt in zip((w, b, x), layouts, dtypes, strict=True))
    # The reference: the same (rounded) values, in float64.
    ref = {"w": w.double().requires_grad_(grad), "b": b.double().requires_grad_(grad)}
    ref_x = x.double().requires_grad_(grad)
    expected = _torch_loop(ref, ref_x)
    for leaf in (w, b, x):
        leaf.requires_grad_(grad)
    chunk = {"chunk_size": 2} if strategy == "chunks" else {}
    with torch.set_grad_enabled(grad):
        loss = bridge_mr.map_reduce(_client, {"w": w, "b": b}, x, strategy=strategy, **chunk)  # type: ignore[arg-type]
    scale = max(1.0, abs(expected.item()))
    assert loss.dtype == torch.float32
    assert abs(loss.double().item() - expected.item()) <= 1e-5 * scale, (layouts, dtypes)
    if not grad:
        return
    loss.backward()
    expected.backward()
    for got, want in ((w, ref["w"]), (b, ref["b"]), (x, ref_x)):
        assert got.grad is not None
        assert want.grad is not None
        assert got.grad.shape == got.shape
        assert got.grad.dtype == got.dtype
        rtol = _DTYPES[got.dtype]
        torch.testing.assert_close(
            got.grad.double(), want.grad, rtol=rtol, atol=rtol * want.grad.abs().max().item()
        )


_CALL = st.tuples(
    st.tuples(*(st.sampled_from(tuple(_DTYPES)) for _ in range(3))),
    st.tuples(*(st.sampled_from(_LAYOUTS) for _ in range(3))),
    st.booleans(),
    st.integers(0, 2**16),
)


@pytest.fixture(params=["disk", "no-disk"])
def disk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Programs kept on disk (the default) or not: the test starts from fresh runners, which
    read the setting at their first call."""
    if request.param == "no-disk":
        monkeypatch.setenv("BRIDGE_MR_COMPILATION_CACHE", "0")
    bridge_mr.clear_caches()
    yield request.param
    bridge_mr.clear_caches()


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_consecutive_calls_with_changing_layouts_equal_torch(strategy: str, disk: str) -> None:
    del disk  # Used for its setting.

    @settings(max_examples=3, deadline=None, database=None)
    @given(st.lists(_CALL, min_size=3, max_size=4))
    def calls(sequence: list[tuple[tuple[torch.dtype, ...], tuple[str, ...], bool, int]]) -> None:
        for dtypes, layouts, grad, seed in sequence:
            _check_call(strategy, dtypes, layouts, grad, seed)

    calls()


@pytest.mark.parametrize("first", ["row-major", "permuted"])
def test_a_transposed_weight_after_a_plain_one_and_back(first: str) -> None:
    """The issue's case, both ways round, with grad and under `torch.no_grad()`."""
    second = "permuted" if first == "row-major" else "row-major"
    for grad in (True, False):
        for layout in (first, second, first):
            _check_call("vmap", (torch.float32,) * 3, (layout, "row-major", "row-major"), grad, 1)
