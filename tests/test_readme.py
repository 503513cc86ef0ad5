"""The README's code blocks run as written (the FedAvg block gets the `batches` it describes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture(autouse=True)
def _float32_default_promotion():
    # README code is user code: it runs with JAX's default (standard) dtype promotion.
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


def test_from_torch_quickstart_runs_and_trains():
    namespace: dict = {}
    exec(compile(_python_blocks()[0], "README from_torch quickstart", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert all(p.grad is not None for p in namespace["model"].parameters())
    assert namespace["model"][1].running_mean.abs().sum() > 0  # the running statistics moved


def test_torch_quickstart_and_fedavg_blocks_run():
    quickstart, fedavg = _python_blocks()[1:3]
    namespace: dict = {}
    exec(compile(quickstart, "README quickstart", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert all(p.grad is not None for p in namespace["model"].parameters())
    namespace["batches"] = {
        "x": torch.randn(16, 10, 32, 64),
        "y": torch.eye(10)[torch.randint(10, (16, 10, 32))],
    }
    before = namespace["model"].weight.detach().clone()
    exec(compile(fedavg, "README FedAvg", "exec"), namespace)
    assert not torch.equal(before, namespace["model"].weight.detach())


def _block(marker: str) -> str:
    (block,) = [b for b in _python_blocks() if marker in b]
    return block


def test_jax_block_runs(capsys):
    exec(compile(_block("def fedavg_delta"), "README JAX example", "exec"), {})
    assert "Array" in capsys.readouterr().out


def test_retrace_block_sees_the_new_learning_rate():
    import jax
    import jax.numpy as jnp

    import bridge_mr

    namespace: dict = {"jax": jax, "jnp": jnp, "torch": torch, "bridge_mr": bridge_mr}
    exec(compile(_block("class Trainer"), "README retrace example", "exec"), namespace)
    torch.testing.assert_close(namespace["second"], namespace["first"] / 10)


def test_symbolic_block_runs_for_several_client_counts(capsys):
    import jax
    import jax.numpy as jnp

    import bridge_mr

    namespace: dict = {"jax": jax, "jnp": jnp, "bridge_mr": bridge_mr}
    exec(compile(_block("symbolic_shape"), "README symbolic example", "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines  # One line per client count, both the same mean update.
    for line in lines:
        values = [float(v) for v in line.strip("[]").split()]
        assert values == pytest.approx([-0.1] * 3), line
