"""Every alternative of a federated benchmark round computes the same round."""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest
from helpers import assert_trees_all_close

pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)


@pytest.fixture(scope="module")
def workloads(pytestconfig: pytest.Config) -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(pytestconfig.rootpath))
        return importlib.import_module("benchmarks.workloads")


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
