"""Every alternative of a federated round computes the same round; the overhead contestants run."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from helpers import assert_trees_all_close

pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)


@pytest.mark.parametrize("algo", ["fedsgd", "fedavg"])
def test_alternatives_compute_the_same_round(workloads: ModuleType, algo: str) -> None:
    cfg = workloads.FedConfig(algo, "small", clients=3, batch=4, local_steps=2, lr=0.5)
    model = workloads.torch_model(cfg.widths)
    names = [name for name, _ in model.named_parameters()]
    initial = [p.detach().numpy().copy() for p in model.parameters()]
    rounds = {}
    for alternative in workloads.ALTERNATIVES:
        fn = workloads.build(alternative, cfg)
        assert callable(fn), fn
        result = fn()  # drjax: a dict of arrays; the torch ones: the parameters in order.
        params = [result[n] for n in names] if isinstance(result, dict) else result
        rounds[alternative] = list(params)
    reference = rounds.pop("torch_loop")
    moved = max(
        float(np.abs(r.detach().numpy() - i).max()) for r, i in zip(reference, initial, strict=True)
    )
    assert moved > 1e-3  # The round changed the parameters, so agreement means something.
    for params in rounds.values():
        assert_trees_all_close(params, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["map_reduce", "torch_function"])
def test_overhead_contestants_run(workloads: ModuleType, kind: str) -> None:
    contestants = (
        workloads.map_reduce_contestants(3, 4, 5)
        if kind == "map_reduce"
        else workloads.torch_function_contestants(4, 5)
    )
    assert len(contestants) == 4
    for fn in contestants.values():
        assert fn() is None  # Each waits for its own results: nothing for the harness to sync.
