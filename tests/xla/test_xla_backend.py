"""call_jax_on_xla: JAX functions inside torch-xla's lazy graph (runs in .venv-xla)."""

from __future__ import annotations

import gc
import re
import textwrap
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_trees_all_close

from bridge_mr.runners import call_jax_on_xla, is_xla_tensor

pytestmark = pytest.mark.xla


def _to_xla(xla: Any, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device copies that are materialized, so that a later graph holds no pending ops for them."""
    device_tensors = [t.to(xla.device()) for t in tensors]
    xla.sync()
    return device_tensors


def _compiles(xla: Any) -> int:
    return xla.debug.metrics.counter_value("UncachedCompile") or 0


def _mixed(x: jax.Array, n: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
    y = jnp.tanh(x) @ w
    return y, jnp.cumsum(n * 2, axis=0), jnp.max(x, axis=1) > 0


def test_results_match_jax_for_several_dtypes_and_outputs(xla: Any) -> None:
    rng = np.random.default_rng(0)
    x, w = (rng.normal(size=shape).astype(np.float32) for shape in [(4, 3), (3, 2)])
    n = np.arange(8, dtype=np.int32)
    got = call_jax_on_xla(_mixed, _to_xla(xla, *map(torch.from_numpy, (x, n, w))))
    assert [t.dtype for t in got] == [torch.float32, torch.int32, torch.bool]
    assert all(is_xla_tensor(t) for t in got)
    # Two XLA CPU builds (jaxlib's and torch-xla's) may differ in the last bits of tanh.
    assert_trees_all_close(got, list(jax.jit(_mixed)(x, n, w)), rtol=1e-5, atol=1e-6)


def test_accepts_a_jitted_function_returning_a_list(xla: Any) -> None:
    program = jax.jit(lambda a, b: [a * b, a - b])
    a, b = torch.arange(6.0).reshape(2, 3), torch.full((2, 3), 2.0)
    got = call_jax_on_xla(program, _to_xla(xla, a, b))
    assert_trees_all_close(got, [a * b, a - b])


def test_is_xla_tensor_tells_devices_apart(xla: Any) -> None:
    assert is_xla_tensor(torch.ones(2, device=xla.device()))
    assert not is_xla_tensor(torch.ones(2))
    assert not is_xla_tensor(torch.ones(2, device="meta"))


def test_outputs_are_lazy_and_never_require_grad(xla: Any) -> None:
    (x,) = _to_xla(xla, torch.ones(3))
    x.requires_grad_(True)
    (y,) = call_jax_on_xla(_exp, [x])
    assert not y.requires_grad
    assert xla._XLAC._get_xla_tensors_text([y]).count("bridge_mr__exp") == 1
    torch.testing.assert_close(y.cpu(), torch.exp(torch.ones(3)))


def _exp(x: jax.Array) -> tuple[jax.Array]:
    return (jnp.exp(x),)


def test_same_function_and_signature_lowers_once_and_compiles_once(xla: Any) -> None:
    traces = []

    def step(x: jax.Array, w: jax.Array) -> tuple[jax.Array]:
        traces.append(x.shape)
        return (jnp.sin(x) @ w,)

    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    xla.debug.metrics.clear_all()
    for i in range(5):
        x = torch.full((2, 3), float(i))
        (y,) = call_jax_on_xla(step, _to_xla(xla, x, w))
        xla.sync()
        torch.testing.assert_close(y.cpu(), torch.sin(x) @ w)
    assert traces == [(2, 3)]
    assert _compiles(xla) == 1
    (y,) = call_jax_on_xla(step, _to_xla(xla, torch.zeros(5, 3), w))
    xla.sync()
    assert traces == [(2, 3), (5, 3)]
    assert _compiles(xla) == 2


def test_cache_does_not_keep_the_function_alive(xla: Any) -> None:
    def double(x: jax.Array) -> tuple[jax.Array]:
        return (x * 2,)

    (y,) = call_jax_on_xla(double, _to_xla(xla, torch.ones(2)))
    torch.testing.assert_close(y.cpu(), torch.full((2,), 2.0))
    ref = weakref.ref(double)
    del double
    gc.collect()
    assert ref() is None


def _loss(w1: jax.Array, w2: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(x @ w1) @ w2 - y) ** 2)


class _VjpPair:
    """A forward returning (loss, *residuals) and a backward taking (*residuals, cotangent)."""

    def __init__(self) -> None:
        self.residual_tree: Any = None

    def forward(self, *primals: jax.Array) -> tuple[jax.Array, ...]:
        loss, vjp_fn = jax.vjp(_loss, *primals)
        residuals, self.residual_tree = jax.tree.flatten(vjp_fn)
        return (loss, *residuals)

    def backward(self, *residuals_and_cotangent: jax.Array) -> tuple[jax.Array, ...]:
        *residuals, cotangent = residuals_and_cotangent
        return jax.tree.unflatten(self.residual_tree, residuals)(cotangent)


def test_vjp_pair_under_torch_autograd_matches_torch_and_compiles_once(xla: Any) -> None:
    pair = _VjpPair()
    forward, backward = pair.forward, pair.backward  # Bound once: the cache keys on the object.

    class Loss(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *primals: torch.Tensor) -> torch.Tensor:
            loss, *residuals = call_jax_on_xla(forward, primals)
            ctx.save_for_backward(*residuals)
            return loss

        @staticmethod
        def backward(ctx: Any, cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(call_jax_on_xla(backward, [*ctx.saved_tensors, cotangent]))

    gen = torch.Generator().manual_seed(0)
    w1, w2, x, y = (torch.randn(shape, generator=gen) for shape in
                    [(3, 5), (5, 1), (7, 3), (7, 1)])  # fmt: skip
    cpu = [t.clone().requires_grad_(True) for t in (w1, w2, x, y)]
    expected = torch.mean((torch.tanh(cpu[2] @ cpu[0]) @ cpu[1] - cpu[3]) ** 2)
    expected.backward()
    on_xla = [t.requires_grad_(True) for t in _to_xla(xla, w1, w2, x, y)]
    loss = Loss.apply(*on_xla)
    loss.backward()
    xla.sync()
    assert_trees_all_close(
        [loss, *(t.grad for t in on_xla)], [expected, *(t.grad for t in cpu)], rtol=1e-5
    )

    params = [p.detach().requires_grad_(True) for p in _to_xla(xla, w1, w2)]
    data = _to_xla(xla, x, y)
    optimizer = torch.optim.SGD(params, lr=0.1)
    losses = []
    xla.debug.metrics.clear_all()
    for _ in range(10):
        optimizer.zero_grad()
        loss = Loss.apply(*params, *data)
        loss.backward()
        optimizer.step()
        xla.sync()
        losses.append(loss.item())
    assert _compiles(xla) == 1  # forward, backward and the SGD update: one graph, compiled once
    assert losses[-1] < losses[0]


def test_restores_the_shardy_flag(xla: Any) -> None:
    (x,) = _to_xla(xla, torch.ones(2))
    before = jax.config.jax_use_shardy_partitioner
    try:
        for shardy in (True, False):
            jax.config.update("jax_use_shardy_partitioner", shardy)

            def fresh(a: jax.Array) -> tuple[jax.Array]:
                return (a + 1,)

            (y,) = call_jax_on_xla(fresh, [x])
            assert jax.config.jax_use_shardy_partitioner is shardy
            torch.testing.assert_close(y.cpu(), torch.full((2,), 2.0))
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def test_rejects_empty_and_non_xla_inputs(xla: Any) -> None:
    with pytest.raises(ValueError, match="at least one XLA tensor"):
        call_jax_on_xla(_exp, [])
    (x,) = _to_xla(xla, torch.ones(2))
    with pytest.raises(ValueError, match=r"tensors\[1\] is on device cpu.*torch_xla.device\(\)"):
        call_jax_on_xla(lambda a, b: (a + b,), [x, torch.ones(2)])
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor; got ndarray"):
        call_jax_on_xla(_exp, [np.ones(2)])


def test_rejects_outputs_that_are_not_a_flat_sequence(xla: Any) -> None:
    (x,) = _to_xla(xla, torch.ones(2))
    with pytest.raises(TypeError, match=r"flat tuple or list of arrays \(`return \(y,\)`"):
        call_jax_on_xla(jnp.sin, [x])
    with pytest.raises(TypeError, match="flat tuple or list"):
        call_jax_on_xla(lambda a: (a, (a, a)), [x])


def test_64_bit_tensor_without_x64_names_the_setting(xla: Any) -> None:
    (x,) = _to_xla(xla, torch.ones(2, dtype=torch.float64))
    with (
        jax.enable_x64(False),
        pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch.float64.*jax_enable_x64"),
    ):
        call_jax_on_xla(_exp, [x])


def _gather(table: jax.Array, rows: jax.Array, cols: jax.Array) -> tuple[jax.Array, ...]:
    return table[rows, cols], rows + cols


def _device_reads(xla: Any) -> int:
    data = xla.debug.metrics.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


def test_int64_tensors_are_cast_to_int32_in_the_graph_after_one_device_read(xla: Any) -> None:
    table = torch.arange(12.0).reshape(3, 4)
    rows, cols = torch.tensor([2, 0, 1]), torch.tensor([[3], [1]])
    on_xla = _to_xla(xla, table, rows, cols)
    with jax.enable_x64(False):
        before = _device_reads(xla)
        picked, summed = call_jax_on_xla(_gather, on_xla)
        assert _device_reads(xla) == before + 1  # One check for both int64 tensors.
        graph = xla._XLAC._get_xla_tensors_text([picked])
        assert graph.count("s32[3]{0} xla::cast(") == 1
        assert graph.count("s32[2,1]{1,0} xla::cast(") == 1
        assert summed.dtype == torch.int32
        torch.testing.assert_close(picked.cpu(), table[rows, cols], rtol=0, atol=0)
        torch.testing.assert_close(summed.cpu(), (rows + cols).to(torch.int32))
        before = _device_reads(xla)
        call_jax_on_xla(_gather, _to_xla(xla, table, rows.int(), cols.int()))
        assert _device_reads(xla) == before  # int32 tensors: nothing to check, no read.


@pytest.mark.parametrize(
    ("dtype", "value", "message"),
    [
        (
            torch.int64,
            2**31,
            "as int32 while JAX's 64-bit mode is off, so its values must lie in "
            "[-2147483648, 2147483647]; it holds 2147483648. Fix: enable x64",
        ),
        (
            torch.uint64,
            2**63,
            "as uint32 while JAX's 64-bit mode is off, so its values must lie "
            "in [0, 4294967295]; it holds 9223372036854775808. Fix: enable x64",
        ),
    ],
    ids=str,
)
def test_an_out_of_range_64_bit_integer_tensor_is_named(
    xla: Any, dtype: torch.dtype, value: int, message: str
) -> None:
    x, ids = _to_xla(xla, torch.ones(3), torch.tensor([0, value, 1], dtype=dtype))
    with (
        jax.enable_x64(False),
        pytest.raises(
            ValueError, match=re.escape(f"tensors[1]: a {dtype} tensor crosses to JAX {message}")
        ),
    ):
        call_jax_on_xla(lambda a, i: (a + i.sum().astype(a.dtype),), [x, ids])


@pytest.mark.x64
def test_with_x64_on_an_int64_tensor_crosses_as_int64(xla: Any) -> None:
    table = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    rows, cols = torch.tensor([2, 0, 1]), torch.tensor([[3], [1]])
    picked, summed = call_jax_on_xla(_gather, _to_xla(xla, table, rows, cols))
    assert "xla::cast" not in xla._XLAC._get_xla_tensors_text([summed])
    assert summed.dtype == torch.int64
    torch.testing.assert_close(picked.cpu(), table[rows, cols], rtol=0, atol=0)


class _SlottedCallable:
    __slots__ = ()

    def __call__(self, x: jax.Array) -> tuple[jax.Array]:
        return (x,)


def test_unreferenceable_function_is_rejected_with_a_fix(xla: Any) -> None:
    (x,) = _to_xla(xla, torch.ones(2))
    with pytest.raises(TypeError, match="weakly referenceable; got _SlottedCallable"):
        call_jax_on_xla(_SlottedCallable(), [x])


def test_importing_bridge_mr_starts_neither_torch_xla_nor_jax_backends(run_child: Any) -> None:
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        import bridge_mr, bridge_mr.demo
        from bridge_mr.runners import is_xla_tensor
        from jax._src import xla_bridge
        print(json.dumps([
            is_xla_tensor(torch.ones(2)),
            "torch_xla" in sys.modules,
            xla_bridge.backends_are_initialized(),
        ]))
        """
    )
    assert run_child(script) == [False, False, False]
