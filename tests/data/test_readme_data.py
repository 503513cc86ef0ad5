"""The README's `bridge_mr.data` block runs as written and learns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_the_client_data_block_runs_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "fd.Dirichlet" in b]
    namespace: dict[str, object] = {}
    with jax.numpy_dtype_promotion("standard"):  # README code is user code.
        exec(compile(block, "README bridge_mr.data block", "exec"), namespace)
    printed = re.search(r"test accuracy after 20 rounds: ([\d.]+)%", capsys.readouterr().out)
    assert printed is not None
    accuracy = namespace["accuracy"]
    assert isinstance(accuracy, torch.Tensor)
    assert float(printed[1]) == pytest.approx(100 * float(accuracy), abs=0.05)
    assert float(accuracy) > 0.5  # ten classes: chance is 0.1
