"""`map_reduce` across processes: each rank passes its own clients, every rank gets the round.

Two torchrun processes x 4 CPU devices (gloo) run `mp_worker.py`; each scenario's results must
be bit-identical on both ranks and match torch (and one process over every client) within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.child import torchrun

WORKER = Path(__file__).with_name("mp_worker.py")


def _run(
    out: Path, processes: int, counts: str, *scenarios: str, check_replicas: bool = False
) -> dict[str, list[dict]]:
    """Runs the scenarios under torchrun; returns each scenario's results, by rank."""
    out.mkdir()
    env = {
        "BRIDGE_MR_CHECK_REPLICAS": "1" if check_replicas else "0",
        "RESULTS_DIR": str(out),
    }
    run = torchrun(WORKER, (counts, *scenarios), processes=processes, env=env, timeout=400)
    assert run.returncode == 0, run.stderr[-6000:]
    results: dict[str, list[dict]] = {s: [{}] * processes for s in scenarios}
    for rank in range(processes):
        for line in (out / f"rank{rank}.txt").read_text().splitlines():
            scenario, values = line.split(" ", 1)
            results[scenario][rank] = json.loads(values)
    for scenario, by_rank in results.items():
        assert all(by_rank), f"{scenario}: a rank wrote no result\n{run.stdout[-4000:]}"
    return results


def _same_on_every_rank(by_rank: list[dict], *keys: str) -> None:
    for key in keys:
        assert len({json.dumps(r[key]) for r in by_rank}) == 1, (key, by_rank)


@pytest.mark.slow
def test_fedsgd_fedavg_gradients_and_refusals_over_two_ranks_with_unequal_counts(
    tmp_path: Path,
) -> None:
    scenarios = (
        "fedsgd_vmap",
        "fedavg",
        "client_gradients",
        "reductions",
        "refusals",
        "large_payload",
    )
    # 4 and 3 clients: rank 1 holds one padding row.
    results = _run(tmp_path / "two", 2, "4,3", *scenarios, check_replicas=True)
    one = _run(tmp_path / "one", 1, "7", "fedsgd_vmap")["fedsgd_vmap"][0]

    fedsgd = results["fedsgd_vmap"]
    _same_on_every_rank(fedsgd, "digest", "losses")  # Bit-identical parameters on both ranks.
    assert fedsgd[0]["max_error"] <= 1e-5  # Against the same steps in torch.
    errors = [abs(a - b) for a, b in zip(fedsgd[0]["params"], one["params"], strict=True)]
    assert max(errors) <= 1e-5  # Against one process over all 7 clients.

    fedavg = results["fedavg"]
    _same_on_every_rank(fedavg, "digest")
    assert fedavg[0]["max_error"] <= 1e-5

    grads = results["client_gradients"]
    assert [g["shape"] for g in grads] == [[4, 6, 5], [3, 6, 5]]  # Each rank's own rows.
    assert all(g["max_error"] <= 1e-6 and g["server_error"] <= 1e-6 for g in grads)

    reductions = results["reductions"]
    _same_on_every_rank(reductions, "n_sum", "n_mean", "mean_dtype")
    assert reductions[0]["n_sum"] == 42  # 7 clients x 6 labels; the padding row not counted.
    assert reductions[0]["n_mean"] == pytest.approx(6.0, rel=1e-6)
    assert reductions[0]["mean_dtype"] == "torch.float32"
    assert reductions[0]["first_sum_error"] <= 1e-5
    assert reductions[0]["first_mean_error"] <= 1e-6

    refusals = results["refusals"]
    _same_on_every_rank(refusals, "errors", "after")  # The same error on every rank.
    errors_seen = refusals[0]["errors"]
    assert refusals[0]["check"] is True
    assert "different programs or signatures" in errors_seen["signature"]
    assert "rank 1: client_loss" in errors_seen["signature"]
    assert "'extra'" in errors_seen["signature"]
    assert "server['2.bias'] differs from rank 0's on rank(s) [1]" in errors_seen["replicas"]
    assert "client counts by rank are [0, 3]" in errors_seen["empty"]
    assert "Use bridge_mr.map_reduce" in errors_seen["torch_reduction"]
    assert refusals[0]["after"] == pytest.approx(fedsgd[0]["losses"][0])

    large = results["large_payload"]
    _same_on_every_rank(large, "digest")
    # float32 sums over 524288 terms, in another order than torch's (one process: the same).
    assert large[0]["relative_error"] <= 1e-4


@pytest.mark.slow
def test_strategies_and_torch_written_clients_over_two_ranks(tmp_path: Path) -> None:
    scenarios = (
        "fedsgd_chunks",
        "fedsgd_per_client",
        "fedsgd_auto",
        "from_torch",
        "refusals",
        "streamed",
        "auto_measured",
    )
    # 5 and 2 clients: rank 1 holds 3 padding rows.
    results = _run(tmp_path / "two", 2, "5,2", *scenarios)
    for strategy in ("chunks", "per_client", "auto"):
        by_rank = results[f"fedsgd_{strategy}"]
        _same_on_every_rank(by_rank, "digest", "losses")
        assert by_rank[0]["max_error"] <= 1e-5, strategy
    _same_on_every_rank(results["from_torch"], "digest")
    assert results["from_torch"][0]["max_error"] <= 1e-5
    # With the replica check off, differing server values are the user's to avoid: no error.
    refusals = results["refusals"]
    assert refusals[0]["check"] is False
    assert set(refusals[0]["errors"]) == {"signature", "empty", "torch_reduction"}
    _same_on_every_rank(refusals, "errors")
    # Streaming each rank's clients in chunks (reduce="sum", gradients accumulated).
    assert all(r["max_error"] <= 1e-6 for r in results["streamed"])
    # "auto" timed every candidate and the ranks agreed on the timings, hence on the pick.
    auto = results["auto_measured"]
    _same_on_every_rank(auto, "strategy", "timed", "seconds")
    assert all(calls >= 1 for calls in auto[0]["timed"]), auto
