"""docs/data.md's whole loop runs as written and learns."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.docs import block


@pytest.mark.slow
def test_the_client_data_block_runs_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    loop = block("docs/data.md", "fd.Dirichlet")
    namespace: dict[str, object] = {}
    with jax.numpy_dtype_promotion("standard"):  # Documented code is user code.
        exec(compile(loop, "docs/data.md loop", "exec"), namespace)
    printed = re.search(r"test accuracy after 20 rounds: ([\d.]+)%", capsys.readouterr().out)
    assert printed is not None
    accuracy = namespace["accuracy"]
    assert isinstance(accuracy, torch.Tensor)
    assert float(printed[1]) == pytest.approx(100 * float(accuracy), abs=0.05)
    assert float(accuracy) > 0.5  # ten classes: chance is 0.1
