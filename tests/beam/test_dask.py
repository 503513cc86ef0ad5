"""bridge_mr.beam on a distributed engine: Beam's DaskRunner over a dask.distributed cluster.

One `LocalCluster` of 2 worker processes per module (starting one costs seconds); its workers
cannot import torch (tests/beam/no_torch_worker.py, preloaded), so every pipeline here also
shows that Beam workers need jax, numpy and apache-beam only.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The torch-xla environment (.venv-xla) collects every module but has no Beam nor dask.
beam = pytest.importorskip("apache_beam")
distributed = pytest.importorskip("distributed")
from apache_beam.io import fileio  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402
from helpers.beam import (  # noqa: E402
    assert_close,
    cnn_loss,
    cnn_records,
    cnn_server,
    jit_of,
    local_sgd,
    parse_client_file,
    write_client_files,
)

import bridge_mr.beam as bb  # noqa: E402
from bridge_mr import jax_core as mr  # noqa: E402

F32 = np.float32
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
IN, HIDDEN, OUT, EXAMPLES = 6, 16, 3, 8


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=2,  # A side input of a user transform is computed inside a task.
        dashboard_address=":0",  # Any free port: no warning if 8787 is taken.
        preload=[str(Path(__file__).with_name("no_torch_worker.py"))],
    ) as local:
        yield local


def dask_options(cluster, **more):
    # As flags: the keyword form of DaskOptions is its dest, `address`, which is easy to get
    # wrong (a misspelt keyword is ignored, and the DaskRunner starts a cluster of its own).
    flags = [f"--runner={DASK_RUNNER}", f"--dask_client_address={cluster.scheduler_address}"]
    return PipelineOptions(flags, **more)


def mlp_loss(params, data):
    hidden = jnp.tanh(data["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - data["y"]) ** 2)


def weighted_fedavg(local):
    """A weighted FedAvg round whose clients run `local`."""

    def fedavg_round(server, data, weight):
        deltas = mr.map_fn(local, (mr.broadcast(server), data))
        return jax.tree.map(jnp.add, server, mr.reduce_weighted_mean(deltas, weight))

    return fedavg_round


# A weighted FedAvg round of a 2-layer MLP: 3 local SGD steps per client.
mlp_round = weighted_fedavg(local_sgd(mlp_loss, 0.1))


def mlp_server():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(F32),
        "b1": np.zeros(HIDDEN, F32),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(F32),
    }


def mlp_records(count, seed):
    rng = np.random.default_rng(seed)
    return [
        (
            {
                "x": rng.normal(size=(EXAMPLES, IN)).astype(F32),
                "y": rng.normal(size=(EXAMPLES, OUT)).astype(F32),
            },
            F32(rng.uniform(0.5, 2.0)),
        )
        for _ in range(count)
    ]


@pytest.mark.slow
def test_a_64_client_mlp_round_on_dask_equals_jit(cluster):
    recs = mlp_records(64, seed=0)
    got = bb.run(mlp_round, (mlp_server(),), recs, pipeline_options=dask_options(cluster))
    assert_close(got, jit_of(mlp_round, mlp_server(), recs))


@pytest.mark.slow
def test_three_consecutive_rounds_on_dask_equal_jit(cluster, tmp_path):
    # The records reach the workers through a path the pipeline's options give them.
    shared = tmp_path / "shared"
    options = dask_options(cluster, temp_location=str(shared))
    server_beam = server_jit = mlp_server()
    for r in range(3):
        recs = mlp_records(24, seed=r)
        server_beam = bb.run(
            mlp_round, (server_beam,), recs, pipeline_options=options, bundle_size=5
        )
        server_jit = jit_of(mlp_round, server_jit, recs)
    assert_close(server_beam, server_jit, tol=1e-4)
    assert shared.is_dir()
    assert list(shared.iterdir()) == []  # Each run removed its own files.


@pytest.mark.slow
def test_the_dask_workers_run_rounds_without_torch(cluster):
    recs = mlp_records(16, seed=3)
    got = bb.run(mlp_round, (mlp_server(),), recs, pipeline_options=dask_options(cluster))
    assert_close(got, jit_of(mlp_round, mlp_server(), recs))

    def worker_state():
        import importlib
        import sys

        try:
            importlib.import_module("torch")
            torch = "importable"
        except ImportError:
            torch = "loaded" if sys.modules.get("torch") is not None else "blocked"
        return torch, "bridge_mr.beam._worker" in sys.modules

    with distributed.Client(cluster) as client:
        states = list(client.run(worker_state).values())
    assert [torch for torch, _ in states] == ["blocked", "blocked"]
    assert any(ran for _, ran in states)  # The round ran on this cluster's workers.


# A weighted FedAvg round of a CNN: conv, max-pool and 3 local SGD steps per client.
cnn_round = weighted_fedavg(local_sgd(cnn_loss, 0.05))


@pytest.mark.slow
def test_a_cnn_round_on_dask_equals_jit(cluster):
    # Convolution, max-pooling and a scan of local steps inside map_fn; 3 bundles of 4 clients
    # for the 2 workers.
    recs = cnn_records(12, seed=7, examples=EXAMPLES, weighted=True)
    got = bb.run(
        cnn_round, (cnn_server(),), recs, pipeline_options=dask_options(cluster), bundle_size=4
    )
    assert_close(got, jit_of(cnn_round, cnn_server(), recs), tol=1e-4)


def test_a_pcollection_read_from_files_on_dask_equals_jit(cluster, tmp_path):
    # The records come from a Beam source (per-client .npz files) that the Dask workers read,
    # parsed by a function the workers import (tests/helpers/beam.py).
    recs = mlp_records(20, seed=5)
    write_client_files(tmp_path, recs)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), recs[0])
    pipeline = beam.Pipeline(options=dask_options(cluster))
    files = (
        pipeline
        | fileio.MatchFiles(str(tmp_path / "client-*.npz"))
        | fileio.ReadMatches()
        | beam.Map(parse_client_file)
    )
    got = bb.run(mlp_round, (mlp_server(),), files, record_spec=spec, bundle_size=6)
    assert_close(got, jit_of(mlp_round, mlp_server(), recs))


def shifted_mean(server, value):
    return server + mr.reduce_mean(value)


@pytest.mark.slow
def test_a_cluster_that_loses_every_worker_fails_the_run_instead_of_waiting_forever(
    tmp_path, monkeypatch
):
    # A function from a module the workers cannot import kills each worker process that
    # receives it (dask 2026.8: 'Failed to deserialize', and the nanny does not restart it);
    # the scheduler would keep the tasks forever. Its own cluster: this one loses its workers.
    monkeypatch.setattr("bridge_mr.beam._waiting.NO_WORKERS_TIMEOUT_S", 3.0)
    (tmp_path / "driver_only.py").write_text("def record(i):\n    return (i,)\n")
    with distributed.LocalCluster(
        n_workers=1, processes=True, threads_per_worker=1, dashboard_address=":0"
    ) as lost:
        monkeypatch.syspath_prepend(str(tmp_path))  # After the worker started: not on its path.
        driver_only = importlib.import_module("driver_only")
        pipeline = beam.Pipeline(options=dask_options(lost))
        records = pipeline | beam.Create([F32(i) for i in range(4)]) | beam.Map(driver_only.record)
        outcome = {}

        def run():
            try:
                outcome["result"] = bb.run(shifted_mean, (F32(1),), records, record_spec=(F32(0),))
            except Exception as error:  # Checked below, in the test's thread.
                outcome["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=240)
    assert not thread.is_alive(), "bridge_mr.beam.run still waits on a cluster with no worker"
    error = outcome.get("error")
    assert isinstance(error, RuntimeError), outcome
    assert "lost every worker" in str(error)
    assert "importable on the workers" in str(error)
