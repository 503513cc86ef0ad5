"""The README's `bridge_mr.algorithms` block runs as written and trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# .venv-xla (the torch_xla leg, which selects none of these tests) has no optax.
pytest.importorskip("optax", reason="needs the algorithms extra: pip install .[algorithms]")

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_the_diloco_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "alg.outer_step" in b and "nesterov=True" in b]
    namespace: dict[str, object] = {}
    with jax.numpy_dtype_promotion("standard"):  # README code is user code.
        exec(compile(block, "README algorithms block", "exec"), namespace)
    assert "mean inner loss" in capsys.readouterr().out
    model = namespace["model"]
    assert isinstance(model, torch.nn.Module)
    assert all(p.grad is None for p in model.parameters())  # zero_grad after the step
    loss = namespace["metrics"]
    assert isinstance(loss, dict)
    assert torch.isfinite(loss["loss"])
