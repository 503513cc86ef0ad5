"""examples/fedavg_xla.py --quick: FedAvg on 4 SPMD devices, bridge_mr beside pure torch-xla."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fedavg_xla.py"


def test_quick_run_trains_the_same_model_as_pure_torch_xla(
    child_stdout: Callable[[Sequence[str]], str],
) -> None:
    output = child_stdout([str(EXAMPLE), "--quick"])
    assert "(4 device(s), SPMD on)" in output
    assert re.search(r"client batches sharded as \{devices=\[4,1,1,1\]", output), output
    runs = dict(re.findall(r"^  (\S+) +loss (\d+\.\d+ -> \d+\.\d+)", output, re.MULTILINE))
    assert set(runs) == {"bridge_mr", "torch.func"}, output
    assert runs["bridge_mr"] == runs["torch.func"]  # the same losses, to 4 decimals
    first, last = map(float, runs["bridge_mr"].split(" -> "))
    assert last < first
