"""One test per `bridge_mr._compat` entry: on the pinned versions, the fast path is the one taken.

Pinned: jax / jaxlib 0.10.2; torch 2.13.0 (.venv) and 2.9.0 (.venv-xla); torch_xla 2.9.0. A
release that moves one of these private names, or turns a zero-copy path into a copy, fails
here rather than silently slowing bridge_mr down (or making it wrong).
"""

from __future__ import annotations

import contextlib
import importlib.util
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.func
from helpers.child import run_python
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from torch._C import _functorch
from torch.utils._pytree import tree_map

from bridge_mr import dlpack
from bridge_mr._compat import jax as compat_jax
from bridge_mr._compat import jaxlib as compat_jaxlib
from bridge_mr._compat import torch as compat_torch
from bridge_mr._compat import torch_xla as compat_torch_xla

_ROOT = Path(__file__).resolve().parents[2]
_HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def _run_python(code: str) -> str:
    """Runs `code` in a fresh interpreter that sees this checkout's bridge_mr; its stdout.

    `bridge_mr` is registered as a bare namespace first, so the submodule under test is
    imported without the package's `__init__` (whatever that imports).
    """
    prelude = textwrap.dedent(
        f"""
        import sys, types
        package = types.ModuleType("bridge_mr")
        package.__path__ = [{str(_ROOT / "bridge_mr")!r}]
        sys.modules["bridge_mr"] = package
        """
    )
    return run_python(["-c", prelude + textwrap.dedent(code)], timeout=120)


# --- bridge_mr._compat.jax ---------------------------------------------------------------------


def test_importing_the_jax_entries_imports_no_torch() -> None:
    out = _run_python(
        """
        import bridge_mr._compat, bridge_mr._compat.jax, bridge_mr._compat.jaxlib
        print(sorted(m for m in ("torch", "torch_xla", "numpy.testing") if m in sys.modules))
        print([m for m in sys.modules if m.startswith("bridge_mr.") and "_compat" not in m])
        """
    )
    assert out.split("\n")[:2] == ["[]", "[]"]


def test_trace_context_is_the_one_jit_keys_on_and_changes_with_x64() -> None:
    before = compat_jax.trace_context()
    hash(before)
    assert compat_jax.trace_context() == before
    with jax.enable_x64(not jax.config.jax_enable_x64):
        assert compat_jax.trace_context() != before
    with jax.numpy_dtype_promotion("standard"):
        assert compat_jax.trace_context() != before
    assert compat_jax.trace_context() == before


def test_concrete_mesh_is_the_one_set_with_set_mesh() -> None:
    mesh = jax.make_mesh((2,), ("clients",), devices=jax.devices()[:2])
    assert compat_jax.concrete_mesh() is None
    with jax.set_mesh(mesh):
        assert compat_jax.concrete_mesh() == mesh
        assert compat_jax.legacy_mesh() is None
    assert compat_jax.concrete_mesh() is None


def test_legacy_mesh_is_the_one_of_a_with_mesh_block() -> None:
    mesh = jax.make_mesh((2,), ("clients",), devices=jax.devices()[:2])
    assert compat_jax.legacy_mesh() is None
    with contextlib.ExitStack() as stack:
        with pytest.warns(DeprecationWarning, match="with mesh:"):
            stack.enter_context(mesh)
        assert compat_jax.legacy_mesh() == mesh
        assert compat_jax.concrete_mesh() is None
    assert compat_jax.legacy_mesh() is None


def test_shardy_partitioner_is_thread_local_and_lowers_to_gspmd() -> None:
    initial = jax.config.jax_use_shardy_partitioner
    assert initial  # jax 0.10's default; the torch-xla runner turns it off.
    mesh = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("a"))

    def constrained(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x * 2, sharding)

    seen_elsewhere: list[bool] = []
    with compat_jax.shardy_partitioner(False):
        assert not jax.config.jax_use_shardy_partitioner
        thread = threading.Thread(
            target=lambda: seen_elsewhere.append(jax.config.jax_use_shardy_partitioner)
        )
        thread.start()
        thread.join()
        gspmd = jax.jit(constrained).lower(jnp.ones(4)).as_text()
    assert seen_elsewhere == [initial]
    assert jax.config.jax_use_shardy_partitioner == initial
    shardy = jax.jit(constrained).lower(jnp.ones(4)).as_text()
    assert "mhlo.sharding" in gspmd
    assert "sdy.sharding" not in gspmd
    assert "sdy.sharding" in shardy


def test_x64_enabled_reads_this_threads_setting() -> None:
    outside = compat_jax.x64_enabled()
    assert outside is jax.config.jax_enable_x64
    seen: list[bool] = []
    with jax.enable_x64(not outside):
        assert compat_jax.x64_enabled() is not outside
        thread = threading.Thread(target=lambda: seen.append(compat_jax.x64_enabled()))
        thread.start()
        thread.join()
    assert seen == [outside]


def test_default_device_is_the_one_of_jax_default_device() -> None:
    device = jax.devices("cpu")[1]
    assert compat_jax.default_device() is None
    with jax.default_device(device):
        assert compat_jax.default_device() is device
    with jax.default_device("cpu"):
        assert compat_jax.default_device() == "cpu"


def test_transfer_guard_host_to_device_is_the_level_in_effect() -> None:
    assert compat_jax.transfer_guard_host_to_device() is None
    with jax.transfer_guard_host_to_device("disallow"):
        assert compat_jax.transfer_guard_host_to_device() == "disallow"
    with jax.transfer_guard("log"):
        assert compat_jax.transfer_guard_host_to_device() == "log"
    assert compat_jax.transfer_guard_host_to_device() is None


def test_backends_generation_changes_only_when_jax_clears_its_backends() -> None:
    # In a fresh interpreter: clearing the backends invalidates every live array.
    out = _run_python(
        """
        import jax, jax.extend.backend
        from bridge_mr._compat import jax as compat_jax
        jax.devices()
        first = compat_jax.backends_generation()
        jax.numpy.ones(3).block_until_ready()
        print(compat_jax.backends_generation() is first)
        jax.extend.backend.clear_backends()
        print(compat_jax.backends_generation() is first)
        """
    )
    assert out.split() == ["True", "False"]


def test_array_impl_is_the_class_of_concrete_arrays() -> None:
    assert type(jnp.ones(2)) is compat_jax.ArrayImpl
    assert type(jax.jit(lambda: jnp.zeros(3))()) is compat_jax.ArrayImpl
    assert type(dlpack.to_jax(torch.ones(2))) is compat_jax.ArrayImpl


def test_dim_expr_is_the_class_of_symbolic_dimensions() -> None:
    (n,) = jax.export.symbolic_shape("n")
    assert isinstance(n, compat_jax.DimExpr)
    assert not isinstance(3, compat_jax.DimExpr)


def test_single_devices_reads_the_device_of_single_device_arrays_only() -> None:
    cpu = jax.devices("cpu")[0]
    array = jax.jit(lambda: jnp.arange(4.0))()
    placed = jax.device_put(jnp.ones(2), cpu)
    assert compat_jax.single_devices([array, placed]) == [next(iter(array.devices())), cpu]
    mesh = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2])
    sharded = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("a")))
    assert compat_jax.single_devices([sharded, np.ones(2), torch.ones(2)]) == [None] * 3


def test_fresh_handle_is_a_new_array_on_the_same_buffer() -> None:
    array = jax.jit(lambda: jnp.arange(4.0))()
    handle = compat_jax.fresh_handle(array)
    assert handle is not array
    assert handle.unsafe_buffer_pointer() == array.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(handle), np.arange(4.0))


# --- bridge_mr._compat.jaxlib ------------------------------------------------------------------


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Replaces `module.name` by a wrapper that records each call's first argument."""
    calls: list[Any] = []
    original = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_installed_jaxlib_has_the_dlpack_signature_bridge_mr_calls() -> None:
    from jax._src.lib import jaxlib_extension_version

    assert jaxlib_extension_version >= compat_jaxlib.EXTENSION_VERSION
    assert "dl_device_type" in (compat_jaxlib._to_buffer.__doc__ or "")


def test_zero_copy_import_goes_through_jaxlib_and_aliases_the_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy(monkeypatch, compat_jaxlib, "_to_buffer")
    tensor = torch.arange(16.0)
    with dlpack.count_conversions() as stats:
        (array,) = dlpack.import_tensors([tensor])
    assert len(calls) == 1
    assert (stats.imports, stats.copies) == (1, 0)
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    tensor.mul_(10)  # A copy would not see this write.
    np.testing.assert_array_equal(np.asarray(array), np.arange(16.0, dtype=np.float32) * 10)


def test_capsule_to_array_aliases_a_transposed_tensor_keeping_its_layout() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    transposed = base.t()
    capsule = torch.utils.dlpack.to_dlpack(transposed)
    array = compat_jaxlib.capsule_to_array(
        capsule, jax.devices("cpu")[0], None, compat_jaxlib.DL_CPU
    )
    assert array.unsafe_buffer_pointer() == base.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), transposed.numpy())


def test_export_goes_through_jaxlib_and_shares_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxlib import _jax

    from bridge_mr.dlpack import _runtime

    # jaxlib's own function, no wrapper (it runs once per output of every call).
    assert compat_jaxlib.array_to_capsule is _jax.buffer_to_dlpack_managed_tensor
    assert _runtime.array_to_capsule is compat_jaxlib.array_to_capsule
    calls = _spy(monkeypatch, _runtime, "array_to_capsule")
    outputs = jax.jit(lambda: (jnp.arange(4.0), jnp.ones(3)))()
    pointers = [o.unsafe_buffer_pointer() for o in outputs]
    with dlpack.count_conversions() as stats:
        shared = dlpack.to_torch(outputs[0])
        (owned,) = dlpack.export_arrays([outputs[1]], sole_owner=True)
    assert len(calls) == 2
    assert calls[0] is not outputs[0]  # a fresh handle: deleting outputs[0] stays safe
    assert calls[1] is outputs[1]  # sole owner: exported as it is
    assert (stats.exports, stats.copies) == (2, 0)
    assert [shared.data_ptr(), owned.data_ptr()] == pointers
    outputs[0].delete()
    np.testing.assert_array_equal(shared.numpy(), np.arange(4.0))


# --- bridge_mr._compat.torch -------------------------------------------------------------------


class _Wrapper(torch.Tensor):
    """A minimal `__torch_dispatch__` wrapper subclass (its storage holds nothing)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        wrapper = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        wrapper.inner = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.inner if isinstance(x, _Wrapper) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_dispatches_to_python_only_for_torch_dispatch_subclasses() -> None:
    assert compat_torch.dispatches_to_python(_Wrapper(torch.ones(2)))
    assert not compat_torch.dispatches_to_python(torch.ones(2))
    assert not compat_torch.dispatches_to_python(torch.nn.Parameter(torch.ones(2)))


def test_forward_ad_active_inside_a_dual_level_only() -> None:
    assert not compat_torch.forward_ad_active()
    with forward_ad.dual_level():
        assert compat_torch.forward_ad_active()
    assert not compat_torch.forward_ad_active()


def test_graph_break_resumes_on_the_pinned_torch_versions() -> None:
    pinned = {"2.13": True, "2.9": False}
    version = ".".join(torch.__version__.split(".")[:2])
    assert compat_torch.graph_break_resumes() is pinned[version]


def test_eval_frame_callback_is_dynamos_and_unset_in_plain_code() -> None:
    assert compat_torch.eval_frame_callback is torch._C._dynamo.eval_frame.get_eval_frame_callback
    assert compat_torch.eval_frame_callback() is None


@pytest.mark.skipif(
    not compat_torch.graph_break_resumes(), reason="graph_break(msg=) is used on torch 2.13 only"
)
def test_graph_break_stops_a_fullgraph_compile_with_its_reason() -> None:
    def breaks(x: torch.Tensor) -> torch.Tensor:
        compat_torch.graph_break("the reason bridge_mr gives")
        return x + 1

    with pytest.raises(Exception, match="the reason bridge_mr gives"):
        torch.compile(breaks, fullgraph=True, backend="eager")(torch.ones(2))


def test_functorch_transforms_active_inside_torch_func_transforms_only() -> None:
    seen: list[bool] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(compat_torch.functorch_transforms_active())
        return x.sum()

    assert not compat_torch.functorch_transforms_active()
    torch.func.grad(record)(torch.ones(2))
    torch.func.vmap(record)(torch.ones(2, 3))
    assert seen == [True, True]
    assert not compat_torch.functorch_transforms_active()


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _PythonApplyRefused(_Double):
    """`_Double` whose Python `apply` raises: only torch's C++ apply can run it."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Python Function.apply was called")


def test_autograd_apply_calls_the_cpp_apply_directly() -> None:
    fast = compat_torch.autograd_apply(_PythonApplyRefused)
    x = torch.ones(3, requires_grad=True)
    y = fast(x)
    assert type(y.grad_fn).__name__ == "_PythonApplyRefusedBackward"
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with pytest.raises(AssertionError, match=r"Python Function\.apply"):
        torch.func.grad(lambda v: fast(v).sum())(torch.ones(3))  # transforms: Python apply


def test_autograd_apply_under_a_transform_uses_torchs_apply() -> None:
    fast = compat_torch.autograd_apply(_Double)
    grad = torch.func.grad(lambda v: fast(v).sum())(torch.ones(3))
    assert torch.equal(grad, torch.full((3,), 2.0))


def test_autograd_apply_unwraps_dead_functorch_wrappers_as_torch_does() -> None:
    escaped: list[torch.Tensor] = []

    def leak(v: torch.Tensor) -> torch.Tensor:
        escaped.append(v * 1)
        return v.sin()

    torch.func.vjp(leak, torch.ones(2))
    (dead,) = escaped
    assert _functorch.is_dead_tensor_wrapper(dead)
    c_apply: Callable[..., torch.Tensor] = super(torch.autograd.Function, _Double).apply
    assert c_apply(dead).requires_grad  # Without unwrapping, the dead level's graph leaks in.
    out = compat_torch.autograd_apply(_Double)(dead)
    reference = _Double.apply(dead)
    assert not _functorch.is_functorch_wrapped_tensor(out)
    assert out.requires_grad == reference.requires_grad == False  # noqa: E712
    assert torch.equal(out, reference)


def test_autograd_apply_refuses_other_classes() -> None:
    with pytest.raises(TypeError, match=r"autograd_apply\(function_cls\) expects"):
        compat_torch.autograd_apply(torch.nn.Linear)  # type: ignore[arg-type]


def test_flatten_dense_tensors_concatenates_into_new_memory() -> None:
    parts = [torch.arange(4.0).reshape(2, 2), torch.ones(3), torch.tensor(7.0)]
    flat = compat_torch.flatten_dense_tensors(parts)
    assert flat.is_contiguous()
    assert flat.dim() == 1
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in parts]))
    assert all(flat.data_ptr() != p.data_ptr() for p in parts)


def test_tensor_from_capsule_shares_the_capsules_memory() -> None:
    array = jax.jit(lambda: jnp.arange(4.0))()
    tensor = compat_torch.tensor_from_capsule(compat_jaxlib.array_to_capsule(array, None))
    assert type(tensor) is torch.Tensor
    assert tensor.data_ptr() == array.unsafe_buffer_pointer()


# --- bridge_mr._compat.torch_xla ---------------------------------------------------------------


def test_importing_the_torch_xla_entry_imports_no_torch_xla() -> None:
    out = _run_python(
        """
        import bridge_mr._compat.torch_xla
        print("torch_xla" in sys.modules)
        """
    )
    assert out.split() == ["False"]


@pytest.mark.skipif(_HAS_TORCH_XLA, reason="torch_xla is installed here (.venv-xla)")
def test_import_torch_xla_without_torch_xla_says_how_to_install() -> None:
    with pytest.raises(ImportError, match="needs torch_xla") as info:
        compat_torch_xla.import_torch_xla()
    assert compat_torch_xla.INSTALL_HINT in str(info.value)
    assert compat_torch_xla.INSTALL_HINT == "pip install torch==2.9.0 torch_xla==2.9.0"


@pytest.mark.xla
def test_import_torch_xla_returns_its_modules_and_private_workarounds_once() -> None:
    modules = compat_torch_xla.import_torch_xla()
    assert compat_torch_xla.import_torch_xla() is modules
    assert modules.workarounds.__name__ == "torch_xla._internal.jax_workarounds"
    assert callable(modules.workarounds.jax_import_guard)
    assert callable(modules.workarounds.jax_env_context)
    assert callable(modules.builder.computation_from_module_proto)
    assert callable(modules.builder.xla_computation_as_func)
    assert callable(modules.runtime.is_spmd)
    assert callable(modules.spmd.get_global_mesh)


def test_jax_clear_caches_is_counted() -> None:
    # DLPack runners compile again after jax.clear_caches(), as jax.jit retraces: they see it
    # through this count (JAX's cache management calls cache_clear on registered caches).
    counter = compat_jax.clear_counter()
    before = counter.count
    jax.clear_caches()
    assert counter.count == before + 1
    assert compat_jax.clear_counter() is counter


def test_version_of_reads_the_counter_in_place_writes_bump() -> None:
    a, b = torch.zeros(2), torch.zeros(3)
    before = list(map(compat_torch.version_of, (a, b)))
    a.add_(1)
    assert list(map(compat_torch.version_of, (a, b))) == [before[0] + 1, before[1]]
