"""The "processes" case: its torchrun worker times both rounds and, with two processes, the
payload's all-reduce and the per-call agreement; the case turns them into rows."""

from __future__ import annotations

from types import ModuleType

import pytest
from helpers.bench import benchmark


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.processes")


def test_payload_counts_the_mlp_parameters(case: ModuleType) -> None:
    assert case.payload(8) == 64 * 8 + 8 + 8 * 10 + 10


@pytest.mark.slow
def test_two_process_worker_times_rounds_all_reduce_and_agreement(case: ModuleType) -> None:
    timings = case.launch(2, (8,), reps=2, timeout=300)
    assert set(timings) == {"fedsgd/8", "fedavg/8"}
    for entry in timings.values():
        for name in ("round", "all_reduce", "agree"):
            assert len(entry[name]) == 2
            assert all(0 < t < 60 for t in entry[name])
