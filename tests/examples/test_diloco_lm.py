"""examples/diloco_lm.py: the torch LM through from_torch equals torch; a tiny run end to end."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import jax
import numpy as np
import pytest
import torch
from helpers.child import run_python
from helpers.examples import EXAMPLES, example_module

import bridge_mr

EXAMPLE = EXAMPLES / "diloco_lm.py"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    with example_module("diloco_lm") as module:
        yield module


@pytest.mark.slow  # converts and compiles a transformer: tens of seconds on a busy machine
def test_the_from_torch_loss_and_gradients_equal_torchs(example: ModuleType) -> None:
    torch.manual_seed(0)
    model = example.CharLM(context=16, d_model=32, layers=2, heads=4)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = torch.randint(0, example.VOCAB, (3, 17))

    loss = bridge_mr.from_torch(lambda p, b: example.lm_loss(model, p, b))
    jax_params = {name: jax.numpy.asarray(p.numpy()) for name, p in params.items()}
    value, grads = jax.value_and_grad(loss)(jax_params, jax.numpy.asarray(batch.int().numpy()))

    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    expected = example.lm_loss(model, leaves, batch)
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), atol=1e-5, rtol=0)
    for name, p in leaves.items():
        assert p.grad is not None
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), atol=1e-5, rtol=0)


def test_the_replicas_and_the_held_out_set_are_disjoint_groups_of_modules(
    example: ModuleType,
) -> None:
    modules = {f"m{i:02d}": bytes([i]) * (100 + i) for i in range(40)}
    corpus = example.split_corpus(modules, 4)
    groups = [*corpus.replica_modules, corpus.held_out_modules]
    names = [name for group in groups for name in group]
    assert sorted(names) == sorted(modules)  # every module once
    assert all(corpus.replica_modules), corpus.replica_modules
    for group, text in zip(corpus.replica_modules, corpus.replicas, strict=True):
        assert group == sorted(group)
        assert len(text) == sum(len(modules[name]) for name in group) + len(group) - 1
    assert corpus.held_out_modules, "the hash holds some modules out"
    with pytest.raises(ValueError, match="--replicas must be at most"):
        example.split_corpus(modules, 40)


@pytest.mark.slow
def test_a_tiny_run_trains_three_ways_and_writes_its_metrics_and_plot(tmp_path: Path) -> None:
    # A fresh interpreter: the example sets XLA_FLAGS before JAX's first computation; warnings
    # are errors there too.
    tiny = "--rounds 3 --inner-steps 3 --replicas 4 --batch 4 --context 16 --d-model 32"
    output = run_python(
        [
            "-W",
            "error",
            str(EXAMPLE),
            *tiny.split(),
            "--layers",
            "1",
            "--heads",
            "2",
            "--eval-windows",
            "32",
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={"JAX_NUMPY_DTYPE_PROMOTION": "strict", "OMP_NUM_THREADS": "1"},
    )
    assert "4 replicas of" in output, output
    assert (tmp_path / "heldout_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "metrics.json").read_text())
    runs = document["runs"]
    assert list(runs) == ["diloco", "data_parallel", "single"]
    param_bytes = 4 * document["n_params"]
    for method, run in runs.items():
        assert run["steps"] == [0, 3, 6, 9], method
        losses = run["held_out"] + run["train"]
        assert all(math.isfinite(x) for x in losses), (method, losses)
        assert run["held_out_perplexity"] == pytest.approx([math.exp(x) for x in run["held_out"]])
    # Same initial model for all three.
    assert len({run["held_out"][0] for run in runs.values()}) == 1
    diloco = runs["diloco"]["held_out"]
    assert diloco[-1] < diloco[0] - 0.1, diloco
    assert runs["diloco"]["bytes_per_step"] == pytest.approx(2 * param_bytes / 3)
    assert runs["data_parallel"]["bytes_per_step"] == 2 * param_bytes
    assert runs["single"]["bytes_per_step"] == 0
