"""The README's torch-xla example runs as written, in a fresh SPMD interpreter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_torch_xla_example_runs(child_stdout):
    [block] = [
        code
        for code in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
        if "import torch_xla" in code
    ]
    out = child_stdout(["-W", "error", "-c", block])
    loss = float(re.search(r"loss after 100 steps: ([0-9.]+)", out).group(1))
    # Fresh random labels every step: the loss stays near chance, log(10) ≈ 2.30.
    assert 2.0 < loss < 2.7
