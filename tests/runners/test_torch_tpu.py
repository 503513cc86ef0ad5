"""The TorchTPU runner's refusals, which need no chip (tests/tpu/test_torch_tpu.py runs it on one):
JAX must be kept to the CPU beside TorchTPU, torch_tpu must be a version bridge_mr was checked on,
and a round of "tpu" tensors runs on one chip, without a JAX mesh or several processes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
import torch

from bridge_mr import runners
from bridge_mr._compat import torch_tpu as torch_tpu_compat

AVALS = [((3,), np.dtype("float32"))]


def _program(x: jax.Array) -> list[jax.Array]:
    return [x + 1]


@pytest.fixture
def jax_platforms() -> Iterator[None]:
    before = jax.config.values.get("jax_platforms")
    yield
    jax.config.update("jax_platforms", before)


@pytest.mark.parametrize("platforms", [None, "tpu,cpu", "tpu"])
def test_jax_must_stay_on_the_cpu_beside_torch_tpu(jax_platforms: None, platforms: str | None):
    jax.config.update("jax_platforms", platforms)
    with pytest.raises(RuntimeError, match=r"JAX_PLATFORMS=cpu .* before Python starts"):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, None)
    # Checked before a program is traced too: a trace may start JAX's backends.
    with pytest.raises(RuntimeError, match=r"JAX_PLATFORMS=cpu .* before Python starts"):
        runners.trace_context("tpu")


def test_without_torch_tpu_the_runner_says_what_to_install(jax_platforms: None):
    if importlib.util.find_spec("torch_tpu") is not None:
        pytest.skip("torch_tpu is installed here: the TorchTPU leg runs this runner")
    jax.config.update("jax_platforms", "cpu")
    with pytest.raises(ImportError, match=r"found torch_tpu none\. Install `pip install "):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, None)


def test_a_mesh_is_refused_for_tpu_tensors():
    mesh = jax.make_mesh((2,), ("clients",))
    with pytest.raises(NotImplementedError, match="TorchTPU tensors run a round on one chip"):
        runners.runner_for("tpu", jax.jit(_program), AVALS, 1, mesh)


class _Recorder:
    """TorchTPU's kernel calls as the runner sees them, recorded; a kernel's results are its
    placeholders' shapes filled with zeros (nothing runs: no chip here)."""

    def __init__(self) -> None:
        self.registered: dict[tuple[str, str], bytes] = {}
        self.calls: list[list[torch.Tensor]] = []
        self.options: list[dict[str, str]] = []  # pushed and not yet popped
        self.options_at_call: list[dict[str, str]] = []
        self.fail = False  # whether the next kernel call raises, as a failing TorchTPU call would

    def kernels(self) -> torch_tpu_compat.Kernels:
        return torch_tpu_compat.Kernels(
            self._register, self._call, self._lookup, "0.2.0", self.options.append, self.options.pop
        )

    def _register(self, name: str, fingerprint: str, *, serialized_mlir_module: bytes) -> None:
        self.registered[name, fingerprint] = serialized_mlir_module

    def _lookup(self, name: str, fingerprint: str) -> bool:
        return (name, fingerprint) in self.registered

    def _call(self, name: str, fingerprint: str, *, inputs, output_shapes, **_: Any):
        assert (name, fingerprint) in self.registered
        self.calls.append(list(inputs))
        self.options_at_call.append({k: v for o in self.options for k, v in o.items()})
        if self.fail:
            raise RuntimeError("the kernel failed")
        return [torch.zeros_like(p) for p in output_shapes]


@pytest.fixture
def recorder(jax_platforms: None, monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    jax.config.update("jax_platforms", "cpu")
    found = _Recorder()
    monkeypatch.setattr(torch_tpu_compat, "kernels", found.kernels)
    return found


def _uses_first_and_last(x: jax.Array, unused: jax.Array, labels: jax.Array) -> list[jax.Array]:
    return [x * 2, labels + 1]


def test_inputs_the_program_drops_are_not_passed_nor_checked(recorder: _Recorder):
    avals = [((3,), np.dtype("float32")), ((2,), np.dtype("int32")), ((2,), np.dtype("int32"))]
    run = runners.runner_for("tpu", jax.jit(_uses_first_and_last), avals, 2, None)
    again = runners.runner_for("tpu", jax.jit(_uses_first_and_last), avals, 2, None)
    assert len(recorder.registered) == 1  # one program, registered once
    x = torch.ones(3)
    out_of_range = torch.tensor([2**40, 0])  # int64, but the program never reads it
    labels = torch.tensor([1, 2])  # int64, cast to int32 after its check
    for runner in (run, again):
        exported, carried = runner([x, out_of_range, labels], [])
        assert [t.dtype for t in exported] == [torch.float32, torch.int32]
        assert carried == []
    passed = recorder.calls[-1]
    assert len(passed) == 2
    assert passed[0] is x
    assert passed[1].dtype == torch.int32
    with pytest.raises(ValueError, match=r"tensors\[2\]: a torch.int64 tensor"):
        run([x, labels, torch.tensor([2**40, 0])], [])


def test_every_call_compiles_at_xla_full_optimization_level(recorder: _Recorder):
    avals = [((3,), np.dtype("float32")), ((2,), np.dtype("int32")), ((2,), np.dtype("int32"))]
    run = runners.runner_for("tpu", jax.jit(_uses_first_and_last), avals, 2, None)
    x, labels = torch.ones(3), torch.tensor([1, 2], dtype=torch.int32)
    for _ in range(2):
        run([x, labels, labels], [])
    assert recorder.options_at_call == [{"xla_optimization_level": "O3"}] * 2
    assert recorder.options == []  # popped after each call
    recorder.fail = True
    with pytest.raises(RuntimeError, match="the kernel failed"):
        run([x, labels, labels], [])
    assert recorder.options == []  # popped after a failed call too


def test_a_value_torch_has_no_dtype_for_is_named(recorder: _Recorder):
    def keys(x: jax.Array) -> list[jax.Array]:
        return [x, jax.random.split(jax.random.key(0), 2)]

    with pytest.raises(TypeError, match=r"its saved value 0 \(key<fry>"):
        runners.runner_for("tpu", jax.jit(keys), AVALS, 1, None)
