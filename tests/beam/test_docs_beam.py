"""docs/beam.md's FedAvg loop runs as written and learns, in process and on a Dask cluster."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.docs import block

PAGE = "docs/beam.md"


@pytest.mark.slow
def test_the_documented_fedavg_loop_on_beam_runs_and_learns():
    fedavg = block(PAGE, "bridge_mr.beam.run(fedavg_round", excluding=("Dask",))
    namespace: dict = {}
    exec(compile(fedavg, "docs/beam.md FedAvg", "exec"), namespace)
    error = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    assert error < 0.5 * np.abs(namespace["true_w"]).max()  # Three rounds moved w toward true_w.


@pytest.mark.slow
def test_the_documented_dask_block_runs_a_round_on_a_local_cluster():
    pytest.importorskip("distributed")
    fedavg = block(PAGE, "bridge_mr.beam.run(fedavg_round", excluding=("Dask",))
    dask = block(PAGE, "DaskRunner", "LocalCluster")
    namespace: dict = {"__name__": "__main__"}
    exec(compile(fedavg, "docs/beam.md FedAvg", "exec"), namespace)
    before = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    exec(compile(dask, "docs/beam.md on Dask", "exec"), namespace)
    after = np.abs(namespace["server"]["w"] - namespace["true_w"]).max()
    assert after < before  # The round on the cluster moved w further toward true_w.


def test_the_documented_runner_options_name_their_runners():
    options = block(PAGE, "FlinkRunner", "SparkRunner", "DataflowRunner")
    namespace: dict = {}
    exec(compile(options, "docs/beam.md runner options", "exec"), namespace)
    for name, runner in (("flink", "FlinkRunner"), ("spark", "SparkRunner")):
        assert namespace[name].get_all_options()["runner"] == runner
    dataflow = namespace["dataflow"].get_all_options()
    assert (dataflow["runner"], dataflow["project"]) == ("DataflowRunner", "my-project")
