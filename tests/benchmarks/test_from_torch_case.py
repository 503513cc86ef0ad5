"""The "from_torch" case: a tiny run of it computes the same FedAvg round three ways and reports
the rows and the issue's two targets."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from helpers.bench import benchmark

# The case's torch loss calls `.long()` on int32 labels, which JAX (x64 off) computes in int32
# with a warning.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Explicitly requested dtype int64 requested in astype:UserWarning"
)


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.from_torch")


def _tiny(workloads: ModuleType, clients: int) -> Any:
    return workloads.round_config("cnn", clients, batch=2, local_steps=2, lr=0.5)


def test_labels_are_the_cnn_rounds_classes(case: ModuleType, workloads: ModuleType) -> None:
    cfg = _tiny(workloads, 2)
    x, y = case.round_data(cfg)
    assert x.shape == (2, 2, 2, 3, 32, 32)
    assert y.dtype == np.int32
    assert y.shape == (2, 2, 2)
    np.testing.assert_array_equal(np.eye(10, dtype=np.float32)[y], workloads.round_data(cfg)[1])


@pytest.mark.slow
def test_a_tiny_run_reports_rows_and_targets(case: ModuleType, workloads: ModuleType) -> None:
    harness = benchmark("harness")
    policy = harness.TimingPolicy(reps=2, min_reps=2, warmup=1, min_sample_s=0.0, budget_s=1.0)
    ctx = harness.Context(quick=True, policy=policy, alternatives=(), memory="none")
    result = case.run(ctx, configs=[_tiny(workloads, 2)])
    ids = [row["id"] for row in result.rows]
    assert ids == ["fedavg/cnn/c2", "fedavg/cnn/c2 first call", "fedavg/cnn/c2 trace (one client)"]
    rounds, first, trace = result.rows
    assert list(rounds["alternatives"]) == [*case.CLIENTS, case.TORCH_VMAP]
    for entry in rounds["alternatives"].values():
        assert "error" not in entry, entry
        assert entry["reps"] == 2
    # The three compute the same first round; torch_vmap is eager torch, so a zero gradient on
    # the bridge_mr side (from_torch under torch.no_grad) would show as a difference here.
    differences = rounds["params"]["max_abs_difference_after_first_round"]
    assert max(differences.values()) < case.AGREEMENT_ATOL
    assert all(entry["reps"] == 1 for entry in first["alternatives"].values())
    assert list(trace["alternatives"]) == list(case.CLIENTS)
    [same, faster] = result.targets
    assert (same["threshold"], same["direction"]) == (1.05, "<=")
    assert (faster["threshold"], faster["direction"]) == (1.5, ">=")
    paired = rounds["alternatives"][case.FROM_TORCH]["ratio_to_baseline"]["median"]
    assert same["value"] == paired  # The JAX twin is the row's baseline.
    assert faster["value"] > 0
