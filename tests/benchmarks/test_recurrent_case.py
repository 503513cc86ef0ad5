"""The "recurrent" case: a tiny run reports the GRU's compile times over sequence lengths (with
equal program sizes) and a Shakespeare LSTM round equal to the torch loop's."""

from __future__ import annotations

from types import ModuleType

import pytest
from helpers.bench import benchmark

# The case's torch loss calls `.long()` on int32 labels, which JAX (x64 off) computes in int32
# with a warning.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Explicitly requested dtype int64 requested in astype:UserWarning"
)


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.recurrent")


@pytest.mark.slow
def test_a_tiny_run_reports_rows_and_the_target(case: ModuleType) -> None:
    harness = benchmark("harness")
    policy = harness.TimingPolicy(reps=2, min_reps=2, warmup=1, min_sample_s=0.0, budget_s=1.0)
    ctx = harness.Context(quick=True, policy=policy, alternatives=(), memory="none")
    tiny = case.ShakespeareConfig(clients=2, local_steps=2, batch=2, seq=6)
    result = case.run(ctx, lengths=(3, 12), rounds=(tiny,))
    ids = [row["id"] for row in result.rows]
    assert ids == ["gru/compile", "gru/trace", "shakespeare/c2", "shakespeare/c2 first call"]
    compile_row, _, rounds, first = result.rows
    assert list(compile_row["alternatives"]) == ["seq3", "seq12"]
    assert compile_row["params"]["equations"]["seq3"] == compile_row["params"]["equations"]["seq12"]
    for row in (rounds, first):
        assert list(row["alternatives"]) == [case.BRIDGE_MR, case.TORCH_LOOP]
        assert all("error" not in entry for entry in row["alternatives"].values()), row
    assert rounds["alternatives"][case.BRIDGE_MR]["reps"] == 2
    difference = rounds["params"]["max_abs_difference_after_first_round"]
    moved = rounds["params"]["max_abs_change_in_first_round"]
    assert difference < case.AGREEMENT_ATOL
    assert moved > 100 * difference, "the round must move the parameters for agreement to count"
    [target] = result.targets
    assert (target["threshold"], target["direction"], target["row"]) == (1.2, "<=", "gru/compile")
    assert target["value"] > 0
