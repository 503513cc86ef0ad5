"""Every alternative of a federated round computes the same round; the overhead contestants run."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)


@pytest.mark.parametrize("algo", ["fedsgd", "fedavg"])
def test_alternatives_compute_the_same_round(
    workloads: ModuleType, assert_same_round: Callable[..., None], algo: str
) -> None:
    cfg = workloads.FedConfig(algo, "small", clients=3, batch=4, local_steps=2, lr=0.5)
    model = workloads.torch_model(cfg.widths)
    assert_same_round(cfg, model, workloads.ALTERNATIVES, moved=1e-3, atol=1e-5)


@pytest.mark.parametrize("kind", ["map_reduce", "torch_function"])
def test_overhead_contestants_run(workloads: ModuleType, kind: str) -> None:
    contestants = (
        workloads.map_reduce_contestants(3, 4, 5)
        if kind == "map_reduce"
        else workloads.torch_function_contestants(4, 5)
    )
    assert len(contestants) == 5
    assert "floor + pure JAX in one call" in contestants
    for fn in contestants.values():
        assert fn() is None  # Each waits for its own results: nothing for the harness to sync.
