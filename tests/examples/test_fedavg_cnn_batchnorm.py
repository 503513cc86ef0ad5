"""examples/fedavg_cnn_batchnorm.py --quick: FedAvg of a BatchNorm CNN, bridge_mr beside torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.child import run_python

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fedavg_cnn_batchnorm.py"


@pytest.mark.slow
def test_quick_run_learns_as_well_as_the_pure_torch_loop(tmp_path: Path) -> None:
    # A fresh interpreter: the example sets XLA_FLAGS before JAX's first computation. Warnings
    # are errors and dtype promotion is strict there too. per_client spares the quick run auto's
    # measurements (a one-off cost that would dominate it); one torch thread keeps the torch
    # loop's thousand tiny steps from spinning on a busy machine (minutes instead of seconds).
    output = run_python(
        ["-W", "error", str(EXAMPLE), "--quick", "--strategy", "per_client"],
        cwd=tmp_path,
        env={"JAX_NUMPY_DTYPE_PROMOTION": "strict", "OMP_NUM_THREADS": "1"},
    )
    assert "16 clients x 89 examples, 360 held out; 8 rounds" in output, output
    runs = re.findall(
        r"^  (\S+) +test accuracy +(\d+\.\d)%  loss (\d+\.\d+) -> (\d+\.\d+)", output, re.MULTILINE
    )
    assert [name for name, *_ in runs] == ["bridge_mr", "torch"], output
    accuracy = {name: float(percent) / 100 for name, percent, _, _ in runs}
    for name, _, first, last in runs:
        assert accuracy[name] >= 0.9, (name, output)
        assert float(last) < 0.5 * float(first), (name, output)
    # Same init and batches; only the dropout masks differ (torch's generator vs JAX keys).
    assert abs(accuracy["bridge_mr"] - accuracy["torch"]) <= 0.03, output
