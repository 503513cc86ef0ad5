"""examples/dp_fedavg_digits.py: a tiny DP-FedAvg run reports epsilon per round and plots."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers.child import run_python

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dp_fedavg_digits.py"


@pytest.mark.slow
def test_a_tiny_run_spends_more_epsilon_with_less_noise(tmp_path: Path) -> None:
    # A fresh interpreter: the example sets XLA_FLAGS before JAX's first computation; warnings
    # are errors there too.
    output = run_python(
        ["-W", "error", str(EXAMPLE), "--rounds", "3", "--noise", "0.7", "1.4", "2.8",
         "--out", str(tmp_path)],
        cwd=tmp_path,
        env={"JAX_NUMPY_DTYPE_PROMOTION": "strict", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert "359 clients x 4 images, 360 held out; 3 rounds" in output, output
    printed = re.findall(r"^  z=(\S+) +round +(\d+): .* epsilon +(\d+\.\d+)", output, re.MULTILINE)
    assert [(z, int(r)) for z, r, _ in printed] == [
        (z, r) for z in ("0.7", "1.4", "2.8") for r in (1, 2, 3)
    ], output
    assert (tmp_path / "dp_fedavg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "metrics.json").read_text())
    reference, *private = document["runs"]
    assert reference["noise_multiplier"] is None
    assert reference["epsilon"] == [None] * 3  # no noise: no finite epsilon
    assert [run["noise_multiplier"] for run in private] == [0.7, 1.4, 2.8]
    finals = []
    for run in private:
        epsilon = run["epsilon"]
        assert all(math.isfinite(e) and e > 0 for e in epsilon), epsilon
        assert epsilon == sorted(epsilon), epsilon
        assert epsilon[0] < epsilon[-1], epsilon
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"])
        finals.append(epsilon[-1])
    assert finals[0] > finals[1] > finals[2], finals  # less noise, more epsilon
    # The printed epsilons are the recorded ones.
    for (_, _, shown), value in zip(
        printed, [e for r in private for e in r["epsilon"]], strict=True
    ):
        assert float(shown) == pytest.approx(value, abs=1e-3)
    # Every run sees the same cohorts (the sampler's seed), so the cohort sizes agree.
    assert len({tuple(run["clients"]) for run in document["runs"]}) == 1
