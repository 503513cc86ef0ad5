"""The README's Apache Beam FedAvg loop runs as written and learns."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_the_readme_fedavg_loop_on_beam_runs_and_learns():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "bridge_mr.beam.run(fedavg_round" in b and "Dask" not in b]
    namespace: dict = {}
    exec(compile(block, "README Beam FedAvg", "exec"), namespace)
    error = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    assert error < 0.5 * np.abs(namespace["true_w"]).max()  # Three rounds moved w toward true_w.


@pytest.mark.slow
def test_the_readme_dask_block_runs_a_round_on_a_local_cluster():
    pytest.importorskip("distributed")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (fedavg,) = [b for b in blocks if "bridge_mr.beam.run(fedavg_round" in b and "Dask" not in b]
    (dask,) = [b for b in blocks if "DaskRunner" in b and "LocalCluster" in b]
    namespace: dict = {"__name__": "__main__"}
    exec(compile(fedavg, "README Beam FedAvg", "exec"), namespace)
    before = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    exec(compile(dask, "README Beam on Dask", "exec"), namespace)
    after = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    assert after < before  # The round on the cluster moved w further toward true_w.
