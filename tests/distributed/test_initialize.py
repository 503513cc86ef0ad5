"""`bridge_mr.distributed.initialize`: torchrun's environment to `jax.distributed`.

The two-process tests launch `python -m torch.distributed.run` (torchrun) with an outer timeout;
each worker has 4 CPU devices, so the global mesh has 8 over two processes.
"""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest
from helpers.child import torchrun

import bridge_mr

_WORKER = textwrap.dedent(
    """
    import sys
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import bridge_mr

    process = bridge_mr.distributed.initialize(heartbeat_timeout_seconds=10)
    import numpy as np
    import torch
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("clients",))
    local = np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * process.rank
    clients = jax.make_array_from_process_local_data(NamedSharding(mesh, P("clients")), local)
    total = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))(clients)
    again = bridge_mr.distributed.initialize(heartbeat_timeout_seconds=10)
    fields = (
        "RESULT", process.rank, process.world_size, process.local_rank, jax.process_count(),
        jax.device_count(), np.asarray(total.addressable_data(0)).tolist(), again is process,
        torch.distributed.is_initialized(),
    )
    # One write of one line: the two ranks share the pipe, and print() of several arguments
    # writes them piece by piece, which interleaved the ranks' lines on a loaded machine.
    sys.stdout.write(" ".join(map(str, fields)) + "\\n")
    sys.stdout.flush()
    """
)


@pytest.mark.slow
def test_two_torchrun_processes_share_one_program_over_their_devices(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    # torchrun's store takes MASTER_PORT; the coordination service takes the next one.
    run = torchrun(script)
    assert run.returncode == 0, run.stderr[-4000:]
    results = sorted(line.split(" ", 1)[1] for line in run.stdout.splitlines() if "RESULT" in line)
    # Column sums of rank 0's rows (0..11) and rank 1's (100..111): the global reduction.
    expected = "[436.0, 444.0, 452.0] True False"
    assert results == [f"0 2 0 2 8 {expected}", f"1 2 1 2 8 {expected}"], run.stdout


def test_outside_torchrun_the_error_names_the_missing_variables() -> None:
    with pytest.raises(
        RuntimeError, match=r"MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK"
    ):
        bridge_mr.distributed.initialize(environ={})
    with pytest.raises(RuntimeError, match=r"variable\(s\) RANK are not set"):
        bridge_mr.distributed.initialize(
            environ={"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        )


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank=2, world_size=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK to be an integer, got 'x'"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size=0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65535"}, "between 1 and 65535"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(environ: dict[str, str], match: str) -> None:
    full = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_RANK": "0", **environ}
    with pytest.raises(ValueError, match=match):
        bridge_mr.distributed.initialize(environ=full)


def test_a_taken_coordinator_port_is_a_clear_error_not_a_crash() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port - 1),
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
        }
        with pytest.raises(RuntimeError, match="BRIDGE_MR_COORDINATOR_PORT"):
            bridge_mr.distributed.initialize(environ=environ)


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job_instead_of_hanging(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    dying = _WORKER.replace(
        "mesh = jax.make_mesh",
        "import os\nif process.rank == 1:\n    os._exit(3)\nmesh = jax.make_mesh",
    )
    assert dying != _WORKER
    script.write_text(dying)
    # Rank 0 waits in a collective for rank 1, which is gone: the job must end, not hang (the
    # outer timeout would fail the test), and end with an error.
    run = torchrun(script, timeout=120)
    assert run.returncode != 0
    assert "RESULT" not in run.stdout
