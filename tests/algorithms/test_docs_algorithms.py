"""docs/algorithms.md's DiLoCo block runs as written and trains."""

from __future__ import annotations

import pytest

# .venv-xla (the torch_xla leg, which selects none of these tests) has no optax.
pytest.importorskip("optax", reason="needs the algorithms extra: pip install .[algorithms]")

import torch
from helpers.docs import block


@pytest.mark.slow
def test_the_diloco_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    diloco = block("docs/algorithms.md", "alg.outer_step", "nesterov=True")
    namespace: dict[str, object] = {}
    with jax.numpy_dtype_promotion("standard"):  # Documented code is user code.
        exec(compile(diloco, "docs/algorithms.md DiLoCo block", "exec"), namespace)
    assert "mean inner loss" in capsys.readouterr().out
    model = namespace["model"]
    assert isinstance(model, torch.nn.Module)
    assert all(p.grad is None for p in model.parameters())  # zero_grad after the step
    loss = namespace["metrics"]
    assert isinstance(loss, dict)
    assert torch.isfinite(loss["loss"])
