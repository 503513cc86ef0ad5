"""The TorchTPU runner's refusals, which need no chip (tests/tpu/test_torch_tpu.py runs it on one):
JAX must be kept to the CPU beside TorchTPU, torch_tpu must be a version bridge_mr was checked on,
and a round of "tpu" tensors runs on one chip, without a JAX mesh or several processes; and what
it hands TorchTPU's kernel calls (recorded), 64-bit integer tensors as their 32-bit words."""

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
from bridge_mr.runners import _narrowing

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
    placeholders' shapes filled with `fill` (nothing runs: no chip here; 1 in a widened
    program's last result says every 64-bit input's values fit)."""

    def __init__(self) -> None:
        self.registered: dict[tuple[str, str], bytes] = {}
        self.calls: list[list[torch.Tensor]] = []
        self.options: list[dict[str, str]] = []  # pushed and not yet popped
        self.options_at_call: list[dict[str, str]] = []
        self.fail = False  # whether the next kernel call raises, as a failing TorchTPU call would
        self.fill = 1

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
        return [torch.full_like(p, self.fill) for p in output_shapes]


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
    labels = torch.tensor([1, 2])  # int64: its 32-bit words, narrowed in the program
    for runner in (run, again):
        exported, carried = runner([x, out_of_range, labels], [])
        assert [t.dtype for t in exported] == [torch.float32, torch.int32]
        assert carried == []  # the program's verdict on the words is not handed on
    assert len(recorder.registered) == 2  # and the program taking words, once
    passed = recorder.calls[-1]
    assert len(passed) == 2
    assert passed[0] is x
    assert passed[1].dtype == torch.int32
    assert passed[1].shape == (2, 2)
    assert passed[1].data_ptr() == labels.data_ptr()  # a view: nothing was copied or cast
    recorder.fill = 0  # the program found a value that does not fit
    with pytest.raises(ValueError, match=r"tensors\[2\]: a torch.int64 tensor"):
        run([x, labels, torch.tensor([2**40, 0])], [])


def test_int32_tensors_run_the_program_as_exported(recorder: _Recorder):
    avals = [((3,), np.dtype("float32")), ((2,), np.dtype("int32")), ((2,), np.dtype("int32"))]
    run = runners.runner_for("tpu", jax.jit(_uses_first_and_last), avals, 2, None)
    labels = torch.tensor([1, 2], dtype=torch.int32)
    run([torch.ones(3), labels, labels], [])
    assert len(recorder.registered) == 1
    assert recorder.calls[-1][1] is labels


def test_the_chips_verdict_and_the_values_read_back_must_agree(recorder: _Recorder):
    avals = [((3,), np.dtype("float32")), ((2,), np.dtype("int32")), ((2,), np.dtype("int32"))]
    run = runners.runner_for("tpu", jax.jit(_uses_first_and_last), avals, 2, None)
    recorder.fill = 0  # says a value does not fit, though every one does
    with pytest.raises(RuntimeError, match=r"inputs \[2\] that do not fit 32 bits"):
        run([torch.ones(3), torch.tensor([1, 2]), torch.tensor([1, 2])], [])


def test_an_int64_tensor_for_a_uint32_input_is_checked_and_cast_in_torch(recorder: _Recorder):
    avals = [((2,), np.dtype("uint32"))]
    run = runners.runner_for("tpu", jax.jit(lambda k: [k + 1]), avals, 1, None)
    run([torch.tensor([1, 2])], [])
    assert recorder.calls[-1][0].dtype == torch.int32  # int64 narrows to int32, as before
    with pytest.raises(ValueError, match=r"tensors\[0\]: a torch.int64 tensor"):
        run([torch.tensor([2**40, 0])], [])


@pytest.mark.parametrize(
    ("dtype", "fitting", "unfitting"),
    [
        (torch.int64, [0, 1, -1, 2**31 - 1, -(2**31)], [2**31, -(2**31) - 1, 2**40, -(2**62)]),
        (torch.uint64, [0, 1, 2**32 - 1], [2**32, 2**63 + 5]),
    ],
)
def test_a_programs_words_give_the_values_and_whether_they_fit(dtype, fitting, unfitting):
    target = np.dtype("int32") if dtype == torch.int64 else np.dtype("uint32")

    def words(values: list[int]) -> jax.Array:
        tensor = torch.tensor(values, dtype=torch.uint64 if dtype == torch.uint64 else dtype)
        wide = tensor.reshape(len(values), 1).expand(len(values), 3)  # not contiguous
        return jax.numpy.asarray(_narrowing.as_pairs(wide).numpy())

    values, fits = _narrowing.from_pairs(words(fitting), target)
    assert bool(fits)
    assert values.dtype == target
    assert np.asarray(values).tolist() == [[v] * 3 for v in fitting]
    for value in unfitting:
        assert not bool(_narrowing.from_pairs(words([*fitting, value]), target)[1])
    scalar = _narrowing.as_pairs(torch.tensor(-5, dtype=torch.int64))
    assert scalar.shape == (2,)
    assert int(_narrowing.from_pairs(jax.numpy.asarray(scalar.numpy()), np.dtype("int32"))[0]) == -5


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
