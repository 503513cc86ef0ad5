"""The fast paths of import, `jit_arguments` and export catch only what they expect.

What a fast path expects (a non-tensor, an unsupported dtype, a tensor without storage, a
deleted array, a dtype without a DLPack equivalent) sends the value to the full path, which
converts it or raises an error naming it; anything else is a bug and propagates unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge_mr import dlpack
from bridge_mr.dlpack import _import, _runtime


class _Bug(Exception):
    """An exception no fast path expects."""


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Quantized tensors are deprecated.
        return torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.qint8)


def _raising(error: BaseException) -> Any:
    def raise_it(*args: Any) -> bool:
        raise error

    return raise_it


@pytest.mark.parametrize("convert", [dlpack.import_tensors, dlpack.jit_arguments])
@pytest.mark.parametrize(
    "error",
    [
        AttributeError("no is_cpu"),
        KeyError(torch.qint8),
        RuntimeError("Cannot access data pointer of Tensor that doesn't have storage"),
        BufferError("cannot export"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_expected_failure_of_the_import_fast_path_takes_the_full_path(
    monkeypatch: pytest.MonkeyPatch, convert: Any, error: BaseException
) -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    monkeypatch.setattr(_import, "_shareable_as_is", _raising(error))
    (array,) = convert([tensor])
    np.testing.assert_array_equal(np.asarray(array), tensor.numpy())


@pytest.mark.parametrize("convert", [dlpack.import_tensors, dlpack.jit_arguments])
def test_an_unexpected_failure_of_the_import_fast_path_propagates(
    monkeypatch: pytest.MonkeyPatch, convert: Any
) -> None:
    monkeypatch.setattr(_import, "_shareable_as_is", _raising(_Bug("a bug")))
    with pytest.raises(_Bug, match="a bug"):
        convert([torch.ones(3)])


@pytest.mark.parametrize("convert", [dlpack.import_tensors, dlpack.jit_arguments])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, r"^tensors\[0\]: expected a torch\.Tensor, got builtins\.int"),  # AttributeError
        (_quantized(), r"^tensors\[0\]: expected .* got a quantized torch\.qint8 tensor"),  # Key
    ],
    ids=["not-a-tensor", "quantized"],
)
def test_values_the_import_fast_path_refuses_get_the_full_paths_error(
    convert: Any, value: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        convert([value])


def test_a_nested_tensor_the_numpy_fast_path_refuses_gets_the_full_paths_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Nested tensors are a prototype.
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"^tensors\[0\]: expected .* got a nested tensor"):
        dlpack.jit_arguments([nested])  # RuntimeError on its sizes in both fast paths.


@pytest.mark.parametrize(
    "error", [RuntimeError("UNIMPLEMENTED"), BufferError("no")], ids=lambda e: type(e).__name__
)
def test_an_expected_failure_of_the_export_fast_path_takes_the_full_path(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    real = _runtime.array_to_capsule
    calls: list[int] = []

    def first_call_fails(array: jax.Array, stream: int | None) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(array, stream)

    monkeypatch.setattr(_runtime, "array_to_capsule", first_call_fails)
    array = jnp.arange(4.0)
    (tensor,) = dlpack.export_arrays([array])
    assert len(calls) == 2  # The fast path's call, then the full path's.
    np.testing.assert_array_equal(tensor.numpy(), np.asarray(array))


def test_an_unexpected_failure_of_the_export_fast_path_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_runtime, "array_to_capsule", _raising(_Bug("a bug")))
    with pytest.raises(_Bug, match="a bug"):
        dlpack.export_arrays([jnp.ones(3)])


def test_arrays_the_export_fast_path_refuses_get_the_full_paths_error() -> None:
    deleted = jnp.ones(3)
    deleted.delete()
    with pytest.raises(TypeError, match=r"^arrays\[0\]: expected a live jax\.Array"):
        dlpack.export_arrays([deleted])  # jaxlib's JaxRuntimeError in the fast path.
    with pytest.raises(TypeError, match=r"^arrays\[0\]: expected a JAX array of a dtype torch"):
        dlpack.export_arrays([jnp.ones(4, jnp.int4)])  # No DLPack equivalent.
