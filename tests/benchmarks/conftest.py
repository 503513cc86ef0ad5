"""Fixtures of the benchmark tests (the benchmarks load through `helpers.bench.benchmark`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from helpers import assert_trees_all_close
from helpers.bench import benchmark


@pytest.fixture(scope="module")
def workloads() -> ModuleType:
    return benchmark("workloads")


@pytest.fixture(scope="module")
def assert_same_round(workloads: ModuleType) -> Callable[..., None]:
    """`assert_same_round(cfg, model, alternatives, moved, atol)`: one round of `cfg` by each
    alternative (`workloads.build`) leaves the parameters of `model` (the round's torch model)
    where "torch_loop"'s does (rtol 1e-4, `atol`), and torch_loop moved them by more than
    `moved`, so that agreeing means something."""

    def check(cfg: Any, model: Any, alternatives: Iterable[str], moved: float, atol: float) -> None:
        names = [name for name, _ in model.named_parameters()]
        initial = [p.detach().numpy().copy() for p in model.parameters()]
        rounds = {}
        for alternative in alternatives:
            fn = workloads.build(alternative, cfg)
            assert callable(fn), fn
            result = fn()  # JAX ones: a dict of arrays; the torch ones: the parameters in order.
            params = [result[n] for n in names] if isinstance(result, dict) else result
            rounds[alternative] = list(params)
        reference = rounds.pop("torch_loop")
        change = max(
            float(np.abs(r.detach().numpy() - i).max())
            for r, i in zip(reference, initial, strict=True)
        )
        assert change > moved
        for params in rounds.values():
            assert_trees_all_close(params, reference, rtol=1e-4, atol=atol)

    return check
