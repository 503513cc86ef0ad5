"""`bridge_mr.from_torch`: when a converted function traces again: a conversion reuses its
trace (and a new one sees the module's eval mode), conversions of different functions are not
retraces, converting the same function on every call warns.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import zoo
from helpers.from_torch import close, state_of
from torch import nn

import bridge_mr

# Each test converts its own functions: bridge_mr sees new function objects of the same code
# from test to test (test_conversion_traces.py counts the traces itself).
pytestmark = pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning")


def test_a_conversion_reuses_its_trace_and_a_new_one_sees_eval_mode() -> None:
    model = zoo.tiny("cnn_batchnorm")
    data = zoo.tiny_data("cnn_batchnorm", 2, 4)
    loss = zoo.tiny_loss(model)

    def fn(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss(state, batch["x"], batch["y"])

    converted = bridge_mr.from_torch(fn, mutable=0)
    counts = []
    for _ in range(3):
        out, _ = bridge_mr.map_reduce(converted, state_of(model), data)
        out.backward()
        counts.append(bridge_mr.trace_counts()["map_reduce"])
    assert counts[0] == counts[-1]
    model.eval()  # read when traced, as jax.jit reads a function's state: convert again
    eval_loss, _ = bridge_mr.map_reduce(bridge_mr.from_torch(fn, mutable=0), state_of(model), data)
    with torch.no_grad():
        expected = torch.stack(
            [loss(state_of(model), data["x"][c], data["y"][c]) for c in range(2)]
        )
    close(eval_loss.detach(), expected.mean(), "eval-mode loss")


def _models_loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(_MODELS[0], params, (x,)).square().mean()


_MODELS = [nn.Linear(3, 2)]


def test_conversions_of_different_functions_are_not_counted_as_retraces() -> None:
    bridge_mr.clear_caches()
    # Every from_torch conversion shares one closure's code: the count follows the torch
    # function that could not be keyed by value (each reads a module), not that closure.
    x = torch.randn(4, 5, 3)
    params = dict(_MODELS[0].named_parameters())

    def first(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).mean()

    def second(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).square().mean()

    def third(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(_MODELS[0], params, (x,)).abs().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error", bridge_mr.RetraceWarning)
        for fn in (first, second, third, _models_loss):
            bridge_mr.map_reduce(bridge_mr.from_torch(fn), params, x, strategy="vmap")


def test_converting_the_same_function_again_on_every_call_warns() -> None:
    bridge_mr.clear_caches()  # The count is per process: start from none.
    x = torch.randn(4, 5, 3)
    params = dict(_MODELS[0].named_parameters())

    def convert_and_call() -> None:
        loss = bridge_mr.from_torch(_models_loss)
        bridge_mr.map_reduce(loss, params, x, strategy="vmap")

    convert_and_call()
    convert_and_call()
    with pytest.warns(bridge_mr.RetraceWarning, match=r"traced _models_loss at .* 3 times"):
        convert_and_call()
