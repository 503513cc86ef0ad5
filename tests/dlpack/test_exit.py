"""A process that ends holding imported tensors, results, their graph and gradients exits cleanly.

XLA's worker threads release an imported tensor after its last execution; torch's capsule
deleter then takes the GIL, and a thread that takes it while the interpreter finalizes is ended
inside a noexcept destructor: `std::terminate`, exit status 134. Before the exit hook
(`bridge_mr.dlpack._owed`), the script below aborted about 1 time in 8 on a busy machine (9 of
40 runs with one CPU device, 8 of 30 with eight; none with the hook): its backward imports the
cotangent, which autograd hands over expanded, by a copy and DLPack. The children run with a
long switch interval, so that a worker waiting for the GIL is not handed it within 5 ms: then
the script aborted about 1 time in 2 without the hook (22 of 40 runs, 25 of 40). A hook that
waited only for the recorded aliases to die still let 1 run in 40 abort on a loaded CI machine
(8 devices): torch's deleter lets the GIL go and takes it back after the alias's weak
references are gone; with that gap widened to 20 ms (an LD_PRELOAD shim on PyEval_SaveThread)
15 of 24 runs aborted, and none with the hook as it is (pins, and waits for frameless thread
states). The in-process tests below check the pin and that wait.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch

from bridge_mr import dlpack
from bridge_mr._compat import torch as torch_compat
from bridge_mr.dlpack import _owed

_RUNS = 40  # Without the hook, all 40 exit cleanly about once in 10**8.
_DEVICE_COUNT = "--xla_force_host_platform_device_count"

_ROUND = textwrap.dedent(
    """
    import sys
    sys.setswitchinterval(10.0)  # The GIL changes hands only where the holder lets it go.
    import jax.numpy as jnp, torch
    import bridge_mr

    def client(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w"]).sum(-1) * p["s"] - y) ** 2)

    g = torch.Generator().manual_seed(0)
    P = {"w": torch.randn(5, 3, generator=g, requires_grad=True),
         "s": torch.ones((), requires_grad=True)}
    DATA = (torch.randn(8, 4, 5, generator=g), torch.randn(8, 4, generator=g))
    # A vector result: its backward is a second program, whose cotangent crosses by DLPack.
    LOSSES = bridge_mr.map_reduce(lambda q, d: client(q, d) * jnp.ones(2), P, DATA,
                                  strategy="vmap")
    LOSSES.sum().backward()
    GRADS = (P["w"].grad, P["s"].grad)
    print(repr([LOSSES.detach().tolist(), GRADS[0].sum().item(), GRADS[1].item()]))
    # Ends holding LOSSES, its graph and the gradients.
    """
)


def _child_env(devices: int, cache: Path) -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    return {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, f"{_DEVICE_COUNT}={devices}"]),
        "JAX_PLATFORMS": "cpu",
        "BRIDGE_MR_CACHE_DIR": str(cache),
        # Compiled in each child: programs loaded from disk did not show the abort.
        "BRIDGE_MR_COMPILATION_CACHE": "0",
    }


def _run_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _ROUND],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_a_process_ending_with_results_graph_and_gradients_exits_cleanly(
    tmp_path: Path, devices: int
) -> None:
    env = _child_env(devices, tmp_path)
    # Two at a time at least: a busy machine is where the abort showed.
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        children = list(pool.map(lambda _: _run_once(env), range(_RUNS)))
    statuses = Counter(child.returncode for child in children)
    failed = [child for child in children if child.returncode != 0]
    detail = f"\nstderr of one:\n{failed[0].stderr[-3000:]}" if failed else ""
    assert statuses == {0: _RUNS}, f"exit statuses of {_RUNS} runs: {dict(statuses)}{detail}"
    assert len({child.stdout for child in children}) == 1


def test_an_import_that_a_live_array_holds_is_not_owed() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()  # transposed: imported by DLPack
    array = dlpack.to_jax(tensor)
    handles = [h for h in list(_owed._HANDLES) if h.data_ptr() == tensor.data_ptr()]
    assert handles, "the import was not recorded"
    assert all(h.data_ptr() != tensor.data_ptr() for h in _owed.owed())
    del array, handles


@pytest.mark.skipif(not _owed.pinnable(), reason="this torch counts references otherwise")
def test_settle_pins_an_import_that_jax_still_holds() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()  # transposed: imported by DLPack
    array = dlpack.to_jax(tensor)
    [alias] = [h for h in list(_owed._HANDLES) if h.data_ptr() == tensor.data_ptr()]
    ref = weakref.ref(alias)
    del alias
    assert _owed.settle(timeout=60)
    pinned = ref()
    assert pinned is not None
    assert all(h is not pinned for h in list(_owed._HANDLES))  # Forgotten: nothing is owed.
    assert torch_compat.use_count(pinned) == 3  # its Python object, the capsule, the pin
    del array  # The capsule's release is no longer torch's last reference: no GIL taken.
    assert torch_compat.use_count(pinned) == 2
    del pinned
    assert ref() is not None  # Pinned for good.


def test_settle_leaves_nothing_owed_by_a_computation_that_read_an_import() -> None:
    @jax.jit
    def slow(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 20, lambda _, y: jnp.tanh(y @ x), x)

    tensor = torch.randn(128, 128).t()
    result = slow(dlpack.to_jax(tensor))  # The import is dropped while the loop may still run.
    assert _owed.settle(timeout=60)
    assert all(h.data_ptr() != tensor.data_ptr() for h in _owed.owed())
    result.block_until_ready()


def test_settle_waits_for_a_thread_inside_a_gil_section() -> None:
    # A thread state without a Python frame, as pybind11 makes for torch's capsule deleter on an
    # XLA worker thread (which lets the GIL go and takes it back while it frees the tensor).
    api = ctypes.pythonapi
    api.PyThreadState_New.restype = ctypes.c_void_p
    api.PyThreadState_New.argtypes = [ctypes.c_void_p]
    api.PyThreadState_Clear.argtypes = [ctypes.c_void_p]
    api.PyThreadState_Delete.argtypes = [ctypes.c_void_p]
    state = api.PyThreadState_New(api.PyInterpreterState_Get())
    try:
        assert _owed._frameless_thread_states() == 1
        assert not _owed.settle(timeout=0.05)
    finally:
        api.PyThreadState_Clear(state)
        api.PyThreadState_Delete(state)
    assert _owed._frameless_thread_states() == 0
    assert _owed.settle(timeout=60)
