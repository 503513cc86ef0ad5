"""Planning needs no Apache Beam: `split` and `interpret` run with apache_beam blocked."""

from __future__ import annotations

import textwrap

import pytest
from helpers.child import run_python

# jax.export serializes the segments with flatbuffers (part of the `beam` extra).
pytest.importorskip("flatbuffers")

_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["apache_beam"] = None  # Blocked: any import of it raises ImportError.
    import numpy as np
    import bridge_mr.beam as bb
    from bridge_mr import jax_core as mr

    def scaled_mean(server, x):
        scaled = mr.map_fn(lambda s, v: v * s, (mr.broadcast(server), x))
        return server + mr.reduce_mean(scaled)

    server = np.float32(2.0)
    plan = bb.split(scaled_mean, (server,), (np.zeros(3, np.float32),))
    records = [(np.full(3, i, np.float32),) for i in range(4)]
    result = bb.interpret(plan, (server,), records, bundle_sizes=[1, 3])
    np.testing.assert_allclose(result, np.full(3, 2.0 + 2.0 * 1.5, np.float32))
    try:
        bb.run
    except ImportError as err:
        print("run:", err)
    print("rounds:", plan.num_rounds)
    """
)


def test_split_and_interpret_work_without_apache_beam():
    out = run_python(["-c", _CHILD], timeout=300)
    assert "rounds: 1" in out.splitlines()
    assert "run: bridge_mr.beam.run builds Apache Beam pipelines and needs apache_beam" in out
