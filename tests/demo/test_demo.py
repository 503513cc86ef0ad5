"""The federated-learning demo through its public entry points: a --quick run and bad input."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from helpers.child import run_python

import bridge_mr
from bridge_mr.demo import DemoConfig, main, run_demo

ALGORITHMS = ("FedSGD", "FedAvg")
QUICK_ROUNDS = 15  # `--quick`, as its help says.


def test_quick_demo_trains_both_algorithms_like_the_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = main(["--quick"])
    out = capsys.readouterr().out
    assert f"(XLA_FLAGS={os.environ['XLA_FLAGS']})" in out
    assert os.environ["XLA_FLAGS"] == bridge_mr.recommended_xla_flags()
    # 16 label-skewed shards of the digits' 1437 training examples, 360 held out.
    header = re.search(r"(\d+) clients x (\d+) examples .* holds (\d+) to (\d+) of the 10", out)
    assert header is not None, out
    clients, per_client, fewest, most = map(int, header.groups())
    assert (clients, per_client) == (16, 88)
    assert 1 <= fewest <= most <= 4
    assert "360 held-out test examples" in out
    assert "written once in torch" in out
    for algorithm in ALGORITHMS:
        for name in ("bridge_mr", "torch.func"):
            run = result.phase(algorithm, name)
            assert len(run.losses) == QUICK_ROUNDS
            assert run.accuracy >= 0.75, (algorithm, name, run.accuracy)
            assert run.losses[-1] < 0.5 * run.losses[0]
            assert f"{algorithm:<9}  {name:<14}" in out
    # Same torch loss, init, data and algorithm (bridge_mr runs the loss through from_torch):
    # FedSGD's trajectories agree to float32 rounding.
    # FedAvg's ten local steps a round amplify rounding differences, slowly.
    fedsgd, fedavg = ([result.phase(a, n) for n in ("bridge_mr", "torch.func")] for a in ALGORITHMS)
    np.testing.assert_allclose(fedsgd[0].losses, fedsgd[1].losses, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fedavg[0].losses[:5], fedavg[1].losses[:5], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fedavg[0].losses, fedavg[1].losses, atol=1e-2)
    assert abs(fedsgd[0].accuracy - fedsgd[1].accuracy) <= 1 / 360 + 1e-9
    assert "largest per-round difference" in out


@pytest.mark.parametrize("clients", [0, 719])
def test_impossible_client_counts_are_refused(clients: int) -> None:
    with pytest.raises(ValueError, match="n_clients must be between 1 and 718"):
        run_demo(DemoConfig(clients=clients, rounds=1), show_progress=False)


def test_command_line_refuses_a_non_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "expected a positive integer; got 0" in capsys.readouterr().err


def test_module_entry_point_runs_cleanly() -> None:
    """`python -m bridge_mr.demo` (scripts/demo.sh's command), warnings as errors."""
    stdout = run_python(["-W", "error", "-m", "bridge_mr.demo", "--help"], timeout=120)
    assert stdout.startswith("usage: python -m bridge_mr.demo")
    assert "--no-baseline" in stdout
