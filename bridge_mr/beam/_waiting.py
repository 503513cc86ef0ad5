"""Waiting for a pipeline to finish, without waiting forever on a Dask cluster with no workers.

A dask.distributed scheduler keeps a computation's tasks until some worker runs them; if every
worker died while a pipeline ran (a worker process dies when it cannot unpickle a task, e.g. a
function from a module only the driver can import), Beam's DaskRunner waits forever. `wait`
raises instead, naming the usual cause.
"""

from __future__ import annotations

import time
from typing import Any

#: Seconds a Dask cluster may have no worker, after losing workers during the run, before
#: `wait` gives up (a nanny restarts a dead worker within a few seconds).
NO_WORKERS_TIMEOUT_S = 30.0
_POLL_S = 1.0


def wait(outcome: Any, started: float) -> None:
    """Waits for `outcome` (a Beam `PipelineResult`) and closes the dask Client it may hold.

    Args:
        outcome: What `pipeline.run()` returned.
        started: `time.time()` before `pipeline.run()`: a worker removed after it was lost to
            this run.

    Raises:
        RuntimeError: On the DaskRunner, the cluster lost every worker during the run and none
            joined for `NO_WORKERS_TIMEOUT_S` seconds.
        Exception: Whatever the pipeline raised.
    """
    # The DaskRunner's result holds the dask Client it opened, which Beam never closes.
    client = getattr(outcome, "client", None)
    try:
        if client is not None:
            _watch(client, list(getattr(outcome, "futures", ())), started)
        outcome.wait_until_finish()
    finally:
        if client is not None:
            client.close()


def _watch(client: Any, futures: list[Any], started: float) -> None:
    """Returns when `futures` are done; raises if the cluster lost its workers meanwhile."""
    import distributed

    alone_since = None
    for future in futures:
        while True:
            try:
                # Waits without fetching the result (wait_until_finish gathers it).
                if future.exception(timeout=_POLL_S) is not None:
                    return  # The pipeline's own error: wait_until_finish raises it.
                break
            except distributed.TimeoutError:
                pass
            if client.nthreads():
                alone_since = None
                continue
            now = time.monotonic()
            alone_since = now if alone_since is None else alone_since
            lost = _removed_workers(client, started)
            # No worker yet and none lost: a cluster still starting (or scaling up from zero).
            if lost and now - alone_since >= NO_WORKERS_TIMEOUT_S:
                client.cancel(futures)
                raise RuntimeError(_lost_message(client, lost))


def _removed_workers(client: Any, started: float) -> list[str]:
    events = client.get_events("all")
    return [
        str(msg.get("worker"))
        for stamp, msg in events
        if stamp >= started and isinstance(msg, dict) and msg.get("action") == "remove-worker"
    ]


def _lost_message(client: Any, lost: list[str]) -> str:
    address = getattr(client.scheduler, "address", "?")
    return (
        f"bridge_mr.beam.run: the Dask cluster at {address} lost every worker while the pipeline "
        f"ran (removed: {', '.join(lost)}) and none has joined for {NO_WORKERS_TIMEOUT_S:g} s; "
        "its tasks would wait forever, so the pipeline was cancelled. A worker process dies like "
        "this when it cannot unpickle a task: every function the pipeline ships (a beam.Map or "
        "DoFn of your own, e.g. the parser of a PCollection of records) must be importable on "
        "the workers — from an installed package, or sent with the dask Client's upload_file — "
        "not from a module only this process can import (a test file, a script's neighbour). "
        "The workers' logs ('Failed to deserialize') name the missing module."
    )
