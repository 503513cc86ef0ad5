"""The CPU runner's staging buffers: a repeated call imports less, and never reads old values."""

from __future__ import annotations

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import bridge_mr
from bridge_mr import dlpack, runners

F32, I32 = np.dtype("float32"), np.dtype("int32")


def _weighted(x, w, ids, big):
    """Small float inputs (packed), an int32 one and a large one (each crosses alone)."""
    return [(x * w).sum() + ids.sum().astype(jnp.float32) + big.mean(), x * 2.0]


def _avals(tensors):
    dtypes = {torch.float32: F32, torch.int32: I32}
    return [(tuple(t.shape), dtypes[t.dtype]) for t in tensors]


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 4, generator=gen),
        torch.randn(4, generator=gen),
        torch.randint(0, 9, (5,), generator=gen, dtype=torch.int32),
        torch.randn(128, 256, generator=gen),  # 128 KiB: over the packing limit
    ]


def _want(tensors):
    return [np.asarray(a) for a in _weighted(*(jnp.asarray(t.detach().numpy()) for t in tensors))]


def test_a_repeated_call_imports_only_what_is_not_packed_and_reads_new_values():
    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
    run(_inputs(0), [])  # The first call packs fresh buffers, then makes the staging ones.
    for seed in (1, 2, 3):
        tensors = _inputs(seed)
        with dlpack.count_conversions() as stats:
            got, _ = run(tensors, [])
        # The int32 and the large tensor cross; the two small float ones are copied into the
        # staging buffer JAX already holds.
        assert (stats.imports, stats.copies) == (2, 0)
        for g, w in zip(got, _want(tensors), strict=True):
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)


def test_writing_to_the_inputs_or_outputs_after_a_call_changes_no_later_result():
    tensors = [*_inputs(0)[:2], torch.zeros(5, dtype=torch.int32), torch.zeros(1)]
    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(tensors), 2, None)
    first, _ = run(tensors, [])
    second, _ = run(tensors, [])
    tensors[0].add_(1.0)
    first[1].zero_()
    second[1].fill_(7.0)
    third, _ = run(tensors, [])
    for g, w in zip(third, _want(tensors), strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)


def test_calls_from_several_threads_each_get_their_own_inputs_results():
    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
    run(_inputs(0), [])
    cases = [_inputs(seed) for seed in range(8)]
    wants = [_want(tensors) for tensors in cases]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(25):
                got, _ = run(cases[k], [])
                for g, w in zip(got, wants[k], strict=True):
                    np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)
        except BaseException as err:  # Reported by the main thread.
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def test_a_first_call_under_inference_mode_leaves_buffers_later_calls_can_write():
    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
    with torch.inference_mode():
        run(_inputs(0), [])
    tensors = _inputs(1)
    got, _ = run(tensors, [])
    np.testing.assert_allclose(got[0].numpy(), _want(tensors)[0], rtol=1e-6)
    with torch.inference_mode():
        tensors = _inputs(2)
        got, _ = run(tensors, [])
    np.testing.assert_allclose(got[0].numpy(), _want(tensors)[0], rtol=1e-6)


def test_a_runner_on_another_default_device_stages_there():
    with jax.default_device(jax.devices("cpu")[1]):
        run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
        run(_inputs(0), [])
        with dlpack.count_conversions() as stats:
            got, _ = run(_inputs(1), [])
    assert stats.imports == 2
    np.testing.assert_allclose(got[0].numpy(), _want(_inputs(1))[0], rtol=1e-6)


@pytest.mark.parametrize("on_disk", ["1", "0"])
def test_the_program_compiles_once_over_calls_that_stage(monkeypatch, on_disk):
    # Off disk the runner calls jax.jit itself, whose cache tells a committed array from the
    # uncommitted numpy view the first call passed: the staging buffers must look the same.
    monkeypatch.setenv("BRIDGE_MR_COMPILATION_CACHE", on_disk)
    compiles: list[str] = []

    def listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for seed in range(4):
            run(_inputs(seed), [])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1


def test_inputs_that_require_grad_leave_no_graph_on_the_buffers():
    # Called in grad mode, as a caller below autograd would not: a copy recorded on the
    # buffers would keep the inputs' graph (and what it saved, `scale`) alive.
    run = runners.runner_for("cpu", jax.jit(_weighted), _avals(_inputs(0)), 2, None)
    refs = []
    for seed in range(3):
        tensors = _inputs(seed)
        scale = torch.full((3, 4), 2.0)
        refs.append(weakref.ref(scale))
        tensors[0] = tensors[0].requires_grad_() * scale
        got, _ = run(tensors, [])
        assert not any(t.requires_grad for t in got)
        np.testing.assert_allclose(got[0].numpy(), _want(tensors)[0], rtol=1e-6)
        del tensors, scale
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


def test_a_subclass_cotangent_after_staged_backwards_is_refused_as_before():
    # The backward runner's inputs are cotangents that autograd hands over, which no key
    # checks: a `__torch_dispatch__` subclass must meet the fresh path's check, not be copied.
    pair = bridge_mr.torch_function(lambda x, w: (x * w, x * 2 * w))
    x, w = torch.randn(3, requires_grad=True), torch.randn(3)
    for _ in range(2):
        torch.autograd.backward(pair(x, w), [torch.ones(3), torch.ones(3)])
    cotangents = [TwoTensor(torch.ones(3), torch.full((3,), 5.0)) for _ in range(2)]
    with pytest.raises(TypeError, match="got a TwoTensor, a tensor subclass with __torch_disp"):
        torch.autograd.backward(pair(x, w), cotangents)


def test_torch_default_device_does_not_reach_the_buffers():
    f = bridge_mr.torch_function(lambda x, w: (x * w).sum())
    x, w = torch.randn(3), torch.randn(3)
    with torch.device("meta"):
        for _ in range(3):
            torch.testing.assert_close(f(x, w), (x * w).sum())


@pytest.mark.parametrize("on_disk", ["1", "0"])
def test_a_transfer_guard_after_staging_on_another_default_device(monkeypatch, on_disk):
    # Under the guard the runner's inputs are imported, not passed as numpy views: they and the
    # buffers must stay on device 1, where the program (on disk: kept for device 1) runs.
    monkeypatch.setenv("BRIDGE_MR_COMPILATION_CACHE", on_disk)
    f = bridge_mr.torch_function(lambda x, w, ids: (x * w).sum() + ids.sum().astype(jnp.float32))
    x, w, ids = torch.randn(3), torch.randn(3), torch.arange(4, dtype=torch.int32)
    with jax.default_device(jax.devices("cpu")[1]):
        for _ in range(2):
            f(x, w, ids)
        with jax.transfer_guard("disallow"):
            torch.testing.assert_close(f(x, w, ids), (x * w).sum() + ids.sum())
