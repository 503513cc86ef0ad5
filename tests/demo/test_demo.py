"""The federated-learning demo through its public entry points: a --quick run and bad input."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from helpers.child import run_python

from bridge_mr.demo import Comparison, DemoConfig, DemoResult, PhaseResult, main, run_demo

ALGORITHMS = ("FedSGD", "FedAvg")
IMPLEMENTATIONS = ("bridge_mr", "torch.func", "torch loop")
BASELINES = IMPLEMENTATIONS[1:]
QUICK_ROUNDS = 15  # `--quick`, as its help says.
DURATION = r"(\d+(?:\.\d+)?) (s|ms)"


def _seconds(value: str, unit: str) -> float:
    return float(value) * (1e-3 if unit == "ms" else 1.0)


def _close(printed: float, exact: float) -> bool:
    """`printed` is `exact` to the demo's three significant digits (or three decimals)."""
    return abs(printed - exact) <= 5e-3 * abs(exact) + 5e-4 * (1e-3 if exact < 1 else 1)


def _table_rows(out: str) -> dict[tuple[str, str], dict[str, float]]:
    """The table's rows: (algorithm, implementation) -> its numbers, in seconds."""
    row = re.compile(
        rf"^(FedSGD|FedAvg) +(bridge_mr|torch\.func|torch loop) +([\d.]+)% +([\d.]+) +{DURATION}"
        rf" +{DURATION} +([\d.e+-]+) +{DURATION}$",
        re.MULTILINE,
    )
    rows = {}
    for m in row.finditer(out):
        rows[m[1], m[2]] = {
            "accuracy": float(m[3]) / 100,
            "final loss": float(m[4]),
            "first": _seconds(m[5], m[6]),
            "later": _seconds(m[7], m[8]),
            "rounds/s": float(m[9]),
            "all": _seconds(m[10], m[11]),
        }
    return rows


def _check_report(result: DemoResult, out: str) -> None:
    """The table, the speed lines and the load line agree with each other and with `result`."""
    rows = _table_rows(out)
    assert set(rows) == {(a, n) for a in ALGORITHMS for n in IMPLEMENTATIONS}, out
    assert f"all {QUICK_ROUNDS} rounds" in out
    for (algorithm, name), row in rows.items():
        run = result.phase(algorithm, name)
        assert len(run.round_seconds) == QUICK_ROUNDS
        assert all(t > 0 for t in run.round_seconds)
        assert row["first"] > 0
        assert row["later"] > 0
        assert row["rounds/s"] > 0
        assert _close(row["first"], run.first_round_seconds), (row, run)
        assert _close(row["later"], run.later_round_seconds), (row, run)
        assert run.later_round_seconds == float(np.median(run.round_seconds[1:]))
        assert math.isclose(run.rounds_per_second, 1 / run.later_round_seconds)
        assert _close(row["rounds/s"], run.rounds_per_second)
        assert _close(row["all"], run.seconds)
        assert math.isclose(run.seconds, sum(run.round_seconds))
        assert row["accuracy"] == pytest.approx(run.accuracy, abs=5e-4)
        assert row["final loss"] == pytest.approx(run.losses[-1], abs=5e-5)

    speed = re.compile(
        rf"^  (FedSGD|FedAvg) vs (torch\.func|torch loop): later rounds ([\d.]+)x "
        rf"(faster|slower) \({DURATION} vs {DURATION}\); first round {DURATION} (slower|faster) "
        rf"\({DURATION} vs {DURATION}\)(.*)$",
        re.MULTILINE,
    )
    lines = list(speed.finditer(out))
    assert [(m[1], m[2]) for m in lines] == [(a, n) for a in ALGORITHMS for n in BASELINES]
    for m, comparison in zip(lines, result.comparisons(), strict=True):
        ours, theirs = rows[m[1], "bridge_mr"], rows[m[1], m[2]]
        # The ratio and the times are the table's; the word says which is larger.
        assert _seconds(m[5], m[6]) == ours["later"]
        assert _seconds(m[7], m[8]) == theirs["later"]
        table_ratio = max(ours["later"], theirs["later"]) / min(ours["later"], theirs["later"])
        assert abs(float(m[3]) - table_ratio) <= 0.005 + 0.011 * table_ratio, (m[0], rows)
        assert m[4] == ("slower" if ours["later"] > theirs["later"] else "faster"), m[0]
        assert (m[4] == "slower") == (comparison.later_ratio > 1)
        assert _seconds(m[12], m[13]) == ours["first"]
        assert _seconds(m[14], m[15]) == theirs["first"]
        assert m[11] == ("slower" if comparison.first_extra_seconds > 0 else "faster")
        assert _close(_seconds(m[9], m[10]), abs(comparison.first_extra_seconds))
        catch_up = comparison.catch_up_rounds
        if catch_up is None:
            assert m[16] == ", never made up: its later rounds are not faster", m[0]
        elif catch_up > 0:
            rounds = "round" if catch_up == 1 else "rounds"
            assert m[16] == f", made up after {catch_up} later {rounds} (this run: 14)", m[0]
    slower = re.search(r"^where bridge_mr is slower in this run: (.*)$", out, re.MULTILINE)
    assert slower is not None, out
    assert slower[1] == result.speed_summary().splitlines()[-1].split(": ", 1)[1]
    first = sum(c.first_extra_seconds > 0 for c in result.comparisons())
    if first:
        assert slower[1].startswith(f"its first round, in {first} of 4 comparisons ("), slower[1]
    for c in result.comparisons():
        named = f"{c.ours.algorithm}'s later rounds against {c.theirs.implementation}"
        assert (named in slower[1]) == (c.later_ratio > 1), slower[1]
    load = re.search(r"in cores of \d+: FedSGD ([\d.]+), FedAvg ([\d.]+)(.*)$", out, re.MULTILINE)
    assert load is not None, out
    others = [result.phase(a, "bridge_mr").other_cpu for a in ALGORITHMS]
    assert all(cpu is not None and cpu >= 0 for cpu in others), others  # Linux: /proc/stat
    assert [float(load[1]), float(load[2])] == [round(cpu or 0, 2) for cpu in others]
    if max(cpu or 0 for cpu in others) >= 0.25:
        assert load[3].startswith(": the machine was busy, so these times are not"), load[0]
    else:
        assert load[3] == " (quiet)", load[0]


def test_quick_demo_trains_both_algorithms_like_the_baselines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As `python -m bridge_mr.demo` runs on a fresh machine: no XLA_FLAGS (JAX's backend, started
    # by the conftest's, is not affected).
    monkeypatch.delenv("XLA_FLAGS")
    threads = torch.get_num_threads()
    result = main(["--quick"])
    out = capsys.readouterr().out
    assert torch.get_num_threads() == threads  # The demo's one thread is restored afterwards.
    assert f"1 torch thread(s) (this process's before the demo: {threads};" in out
    assert "(XLA_FLAGS=)" in out
    # 64 label-skewed shards of the digits' 1437 training examples, 360 held out.
    header = re.search(r"(\d+) clients x (\d+) examples .* holds (\d+) to (\d+) of the 10", out)
    assert header is not None, out
    clients, per_client, fewest, most = map(int, header.groups())
    assert (clients, per_client) == (64, 22)
    assert 1 <= fewest <= most <= 4
    assert "360 held-out test examples" in out
    assert "written once in torch" in out
    for algorithm in ALGORITHMS:
        for name in IMPLEMENTATIONS:
            run = result.phase(algorithm, name)
            assert len(run.losses) == QUICK_ROUNDS
            assert run.accuracy >= 0.75, (algorithm, name, run.accuracy)
            assert run.losses[-1] < 0.5 * run.losses[0]
    # Same torch model, init, data and algorithm (bridge_mr runs the loss through from_torch):
    # FedSGD's trajectories agree to float32 rounding.
    # FedAvg's ten local steps a round amplify rounding differences (ReLU kinks), slowly: its
    # first five rounds agree as closely as torch's two baselines agree with each other (on an
    # Intel Xeon with AVX-512 and AMX, torch.func and the torch loop differed by 1.9e-4 of the
    # loss there, bridge_mr and torch.func by 1.8e-4; elsewhere all three within 1e-4).
    fedavg_baselines = [np.asarray(result.phase("FedAvg", name).losses[:5]) for name in BASELINES]
    spread = float(np.max(np.abs(fedavg_baselines[0] - fedavg_baselines[1]) / fedavg_baselines[1]))
    for name in BASELINES:
        fedsgd, fedavg = ((result.phase(a, "bridge_mr"), result.phase(a, name)) for a in ALGORITHMS)
        np.testing.assert_allclose(fedsgd[0].losses, fedsgd[1].losses, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(
            fedavg[0].losses[:5], fedavg[1].losses[:5], rtol=max(1e-4, 2 * spread), atol=1e-6
        )
        np.testing.assert_allclose(fedavg[0].losses, fedavg[1].losses, atol=1e-2)
        assert abs(fedsgd[0].accuracy - fedsgd[1].accuracy) <= 1 / 360 + 1e-9
    assert "largest per-round FedSGD loss difference from bridge_mr: torch.func " in out
    _check_report(result, out)


def _phase(implementation: str, first: float, later: list[float]) -> PhaseResult:
    return PhaseResult(
        algorithm="FedAvg",
        implementation=implementation,
        losses=[1.0] * (1 + len(later)),
        accuracy=0.9,
        round_seconds=[first, *later],
    )


def test_comparison_says_where_bridge_mr_is_slower() -> None:
    ours = _phase("bridge_mr", 3.0, [0.010, 0.012, 0.011])  # median 11 ms
    faster_later = _phase("torch loop", 0.05, [0.060, 0.062, 0.200])  # median 62 ms
    slower_later = _phase("torch.func", 0.02, [0.008, 0.009, 0.009])  # median 9 ms
    result = DemoResult(phases=[ours, slower_later, faster_later], seconds=4.0)
    func, loop = result.comparisons()
    assert (func.theirs, loop.theirs) == (slower_later, faster_later)
    assert func.later_ratio == pytest.approx(0.011 / 0.009)
    assert func.first_extra_seconds == pytest.approx(2.98)
    assert func.catch_up_rounds is None
    assert loop.catch_up_rounds == math.ceil((3.0 - 0.05) / (0.062 - 0.011))  # 58
    assert func.describe() == (
        "FedAvg vs torch.func: later rounds 1.22x slower (11.0 ms vs 9.00 ms); first round "
        "2.98 s slower (3.00 s vs 20.0 ms), never made up: its later rounds are not faster"
    )
    assert loop.describe() == (
        "FedAvg vs torch loop: later rounds 5.64x faster (11.0 ms vs 62.0 ms); first round "
        "2.95 s slower (3.00 s vs 50.0 ms), made up after 58 later rounds (this run: 3)"
    )
    assert result.speed_summary().splitlines()[-1] == (
        "where bridge_mr is slower in this run: its first round, in 2 of 2 comparisons "
        "(2.95 s to 2.98 s more: tracing the torch code into JAX, XLA compilation, "
        "strategy=\"auto\"'s choice); FedAvg's later rounds against torch.func "
        "(1.22x its time)"
    )


def test_a_first_round_no_slower_needs_no_catching_up() -> None:
    comparison = Comparison(_phase("bridge_mr", 0.01, [0.02]), _phase("torch loop", 0.5, [0.01]))
    assert comparison.catch_up_rounds == 0
    assert comparison.describe().endswith("first round 490 ms faster (10.0 ms vs 500 ms)")
    assert DemoResult(phases=[comparison.ours], seconds=1.0).speed_summary() == ""
    once = Comparison(_phase("bridge_mr", 0.5, [0.01]), _phase("torch loop", 0.1, [0.5]))
    assert once.catch_up_rounds == 1
    assert once.describe().endswith(", made up after 1 later round (this run: 1)")


@pytest.mark.parametrize(
    ("clients", "message"),
    [
        (0, r"Shards\(num_clients=...\): expected an int >= 1, got 0"),
        (719, r"719 clients x 2 shards .* need 1438 examples, got 1437\. Fix: fewer clients"),
    ],
)
def test_impossible_client_counts_are_refused(clients: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_demo(DemoConfig(clients=clients, rounds=2), show_progress=False)


def test_a_single_round_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rounds must be at least 2 .*; got 1"):
        run_demo(DemoConfig(rounds=1), show_progress=False)


def test_no_torch_threads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"torch_threads must be at least 1 .*; got 0"):
        run_demo(DemoConfig(torch_threads=0), show_progress=False)


@pytest.mark.parametrize(
    ("flag", "least"), [("--rounds", 2), ("--clients", 1), ("--torch-threads", 1)]
)
def test_command_line_refuses_too_small_counts(
    capsys: pytest.CaptureFixture[str], flag: str, least: int
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([flag, str(least - 1)])
    assert exit_info.value.code == 2
    assert f"expected an integer of at least {least}; got {least - 1}" in capsys.readouterr().err


def test_module_entry_point_runs_cleanly() -> None:
    """`python -m bridge_mr.demo` (scripts/demo.sh's command), warnings as errors."""
    stdout = run_python(["-W", "error", "-m", "bridge_mr.demo", "--help"], timeout=120)
    assert stdout.startswith("usage: python -m bridge_mr.demo")
    assert "--no-baseline" in stdout
