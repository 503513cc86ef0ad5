"""The "diloco" case: a tiny run computes the same DiLoCo round three ways and reports its rows."""

from __future__ import annotations

from types import ModuleType

import pytest
from helpers.bench import benchmark


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.diloco")


def test_the_case_is_registered(case: ModuleType) -> None:
    main = benchmark("__main__")
    assert main.CASES["diloco"] is case.run
    assert [cfg.replicas for cfg in case.QUICK] == [cfg.replicas for cfg in case.FULL] == [8, 64]


@pytest.mark.slow
def test_a_tiny_run_reports_rows_that_agree(case: ModuleType) -> None:
    harness = benchmark("harness")
    policy = harness.TimingPolicy(reps=2, min_reps=2, warmup=1, min_sample_s=0.0, budget_s=1.0)
    ctx = harness.Context(quick=True, policy=policy, alternatives=(), memory="none")
    tiny = case.DilocoConfig(3, inner_steps=2, batch=2, context=8, d_model=16, layers=1, heads=2)
    result = case.run(ctx, configs=[tiny])
    assert [row["id"] for row in result.rows] == ["diloco/lm/r3", "diloco/lm/r3 first call"]
    rounds, first = result.rows
    assert list(rounds["alternatives"]) == list(case.ALTERNATIVES)
    for entry in rounds["alternatives"].values():
        assert "error" not in entry, entry
        assert entry["reps"] == 2
        assert entry["replica_steps_per_s"] > 0
    assert rounds["alternatives"]["bridge_mr"]["ratio_to_baseline"]["median"] == 1.0
    # The torch loop and torch.func.vmap are eager torch: a wrong pseudo-gradient, inner
    # optimizer or outer step on the bridge_mr side would show here.
    differences = rounds["params"]["relative_difference_after_first_round"]
    assert set(differences) == {"torch_loop", "torch_vmap"}
    assert max(differences.values()) < case.AGREEMENT_RTOL, differences
    assert all(entry["reps"] == 1 for entry in first["alternatives"].values())
    assert result.targets == []
