"""The "data" case: a tiny run builds the same round's batches two ways and reports its row."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from helpers.bench import benchmark


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.data")


def test_the_case_is_registered(case: ModuleType) -> None:
    main = benchmark("__main__")
    assert main.CASES["data"] is case.run
    assert case.QUICK_CLIENTS == (8, 50)
    assert case.FULL_CLIENTS == (50, 500)


def test_both_builders_give_a_round_of_the_clients_own_images(case: ModuleType) -> None:
    x, y = case.client_data(3)
    for name, build in case.builders(3, "cpu").items():
        bx, by = build()
        assert bx.shape == (3, case.STEPS, case.BATCH, 3, 32, 32), name
        assert by.shape == (3, case.STEPS, case.BATCH, 10), name
        for c in range(3):  # every image of client c's batches is one of its own, none twice
            flat = bx[c].flatten(0, 1).flatten(1)
            hits = (flat[:, None, :] == x[c].flatten(1)[None]).all(-1)
            assert torch.equal(hits.sum(1), torch.ones(case.STEPS * case.BATCH, dtype=torch.int64))
            assert int(hits.any(0).sum()) == case.STEPS * case.BATCH
            assert torch.equal(by[c].flatten(0, 1), y[c][hits.int().argmax(1)])  # its labels


@pytest.mark.slow
def test_a_tiny_run_reports_the_fraction_of_the_round(case: ModuleType) -> None:
    harness = benchmark("harness")
    policy = harness.TimingPolicy(reps=2, min_reps=2, warmup=1, min_sample_s=0.0, budget_s=1.0)
    ctx = harness.Context(quick=True, policy=policy, alternatives=(), clients=(2,))
    result = case.run(ctx)
    [row] = [r for r in result.rows if r["params"]["device"] == "cpu"]
    assert row["id"] == "data/cnn/cpu/c2"
    assert row["params"]["round_s"] > 0
    for name in ("bridge_mr.data", "torch_stack_loop"):
        entry = row["alternatives"][name]
        assert "error" not in entry, entry
        assert entry["reps"] == 2
        assert 0 < entry["fraction_of_round"] == entry["median_s"] / row["params"]["round_s"]
    [target] = [t for t in result.targets if t["row"] == row["id"]]
    assert target["value"] == row["alternatives"]["bridge_mr.data"]["fraction_of_round"]
    assert target["threshold"] == case.TARGET_FRACTION
