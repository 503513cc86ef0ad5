"""examples/fedavg_beam.py: a CNN FedAvg on digits learns through Beam on Dask; equals jit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The torch-xla environment (.venv-xla) collects every module but has no Beam nor dask.
pytest.importorskip("apache_beam")
pytest.importorskip("distributed")
pytest.importorskip("sklearn")

from helpers.examples import example_module

from bridge_mr import jax_core


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    with example_module("fedavg_beam") as module:
        yield module


@pytest.fixture
def keep_xla_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() sets XLA_FLAGS; the tests' own (tests/conftest.py) come back after the test."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


@pytest.mark.slow  # starts a dask cluster of 2 worker processes; each compiles the round
def test_the_quick_run_on_dask_learns(
    example: ModuleType, keep_xla_flags: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run = example.main(["--quick"])
    output = capsys.readouterr().out
    assert "6 clients x 48 images, 360 held out; 3 rounds" in output, output
    assert "DaskRunner on a LocalCluster of 2 worker processes" in output, output
    assert run.runner == "dask"
    assert len(run.accuracy) == 4, run.accuracy  # Before the first round, then after each.
    assert len(run.seconds) == 3, run.seconds
    assert all(s > 0 for s in run.seconds), run.seconds
    # Chance is 10%; 3 rounds of 6 clients reached 79.7% when written.
    assert run.accuracy[-1] >= 0.5, run.accuracy
    assert run.accuracy[-1] >= run.accuracy[0] + 0.3, run.accuracy
    assert "first round" in output, output
    assert "later rounds median" in output, output


def test_the_held_out_images_are_no_clients_and_too_many_clients_are_refused(
    example: ModuleType,
) -> None:
    data = example.load_digits(example.MAX_CLIENTS)
    train = np.concatenate([record[0]["x"] for record in data.records])
    assert len(train) == example.MAX_CLIENTS * example.PER_CLIENT
    assert len(data.test_x) == example.TEST
    # scikit-learn's digits has no two equal images, so equal bytes are the same image.
    seen = {image.tobytes() for image in train}
    assert len(seen) == len(train)  # No image is two clients'.
    assert not any(image.tobytes() in seen for image in data.test_x)
    with pytest.raises(ValueError, match=r"IID: 30 clients of 48 example\(s\) need 1440 .* 1437"):
        example.load_digits(example.MAX_CLIENTS + 1)
    with pytest.raises(SystemExit):
        example.parse_args(["--clients", str(example.MAX_CLIENTS + 1)])


@pytest.mark.slow  # Beam pipelines of the CNN round (about 5 s for the first, once per process)
def test_the_in_process_runner_equals_jit_of_the_same_rounds(
    example: ModuleType, keep_xla_flags: None
) -> None:
    run = example.main(["--runner", "fnapi", "--rounds", "2", "--clients", "4"])
    data = example.load_digits(4)
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *data.records)
    jitted = jax.jit(jax_core.program(clients=4)(example.make_round(local_steps=5)))
    server = example.init(1)
    for _ in range(2):
        server = jitted(server, *stacked)
    assert jax.tree.structure(run.server) == jax.tree.structure(server)
    for got, expected in zip(jax.tree.leaves(run.server), jax.tree.leaves(server), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)
    expected_accuracy = example.accuracy(server, data.test_x, data.test_y)
    assert run.accuracy[-1] == pytest.approx(expected_accuracy, abs=1 / example.TEST)
