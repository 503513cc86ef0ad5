"""`initialize`: `jax.distributed` started from torchrun's environment variables."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import threading
from collections.abc import Mapping, Sequence

import jax

__all__ = ["Process", "current", "initialize"]

#: The variables torchrun sets for every process it starts.
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclasses.dataclass(frozen=True)
class Process:
    """This process's place among the processes `initialize` connected.

    Attributes:
      rank: this process's index, 0 <= rank < world_size (torchrun's RANK).
      world_size: how many processes run the program (torchrun's WORLD_SIZE).
      local_rank: this process's index on its machine (torchrun's LOCAL_RANK).
      coordinator_address: host:port of JAX's coordination service (run by rank 0).
      check_replicas: whether `map_reduce` checks, on every call, that the server tensors are
        equal on every rank (a debug check: one hash of each server tensor per call).

    Example:
      >>> bridge_mr.distributed.Process(
      ...     rank=0, world_size=2, local_rank=0, coordinator_address="10.0.0.1:29501"
      ... )
      Process(rank=0, world_size=2, local_rank=0, coordinator_address='10.0.0.1:29501',
              check_replicas=False)
    """

    rank: int
    world_size: int
    local_rank: int
    coordinator_address: str
    check_replicas: bool = False


_LOCK = threading.Lock()
_STARTED: list[Process] = []  # the process `initialize` connected, once it has


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_rank: int | None = None,
    initialization_timeout_seconds: int = 300,
    heartbeat_timeout_seconds: int = 100,
    check_replicas: bool | None = None,
    local_device_ids: Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Process:
    """Connects this process to the others of its torchrun job through `jax.distributed`.

    Call it once per process, before any JAX computation (as `jax.distributed.initialize`
    requires). Every argument left None is read from torchrun's environment: `RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, and `MASTER_ADDR` with the port after `MASTER_PORT` (torchrun's
    own store listens on `MASTER_PORT` itself; set `BRIDGE_MR_COORDINATOR_PORT` to choose
    another). `torch.distributed` is left alone: set it up yourself if you need it. On CPU, JAX's
    collectives between processes use gloo.

    Args:
      coordinator_address: host:port where rank 0 serves JAX's coordination service.
      num_processes: the number of processes (torchrun's WORLD_SIZE).
      process_id: this process's rank (torchrun's RANK).
      local_rank: this process's index on its machine (torchrun's LOCAL_RANK), for `Process`.
      initialization_timeout_seconds: how long to wait for every process to connect.
      heartbeat_timeout_seconds: after how long without a heartbeat a process counts as dead,
        so that the others fail instead of waiting for it.
      check_replicas: have every `map_reduce` call check that the server tensors are equal on
        every rank, and name those that are not (a debug check; default: the environment
        variable `BRIDGE_MR_CHECK_REPLICAS=1`, else off).
      local_device_ids: the devices of this machine this process uses (JAX's argument of that
        name). Default: on GPUs, `[local_rank]` (torchrun's one GPU per process), where JAX
        would otherwise take every GPU of the machine in every process; on CPU, all.
      environ: the environment to read (default `os.environ`).

    Returns:
      This process's `Process`. A second call with the same arguments returns it again.

    Raises:
      RuntimeError: a torchrun variable an argument left None is not set (the message names
        each missing one), the process already connected with other arguments, or JAX already
        computed in this process.
      ValueError: a variable or argument is out of range or not an integer, or the coordinator
        port is not a valid port.

    Example:
      Under `torchrun --nproc-per-node=2 train.py`, `process = bridge_mr.distributed.initialize()`
      at the top of train.py connects the two processes (`process.rank` is 0 or 1,
      `process.world_size` 2). Started without torchrun, it says what is missing:

      >>> bridge_mr.distributed.initialize(environ={})
      Traceback (most recent call last):
      ...
      RuntimeError: bridge_mr.distributed.initialize: the torchrun variable(s) MASTER_ADDR,
      MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK are not set, ... Fix: start the program with
      torchrun ...
    """
    env = os.environ if environ is None else environ
    needed = {
        "MASTER_ADDR": coordinator_address,
        "MASTER_PORT": coordinator_address,
        "RANK": process_id,
        "WORLD_SIZE": num_processes,
        "LOCAL_RANK": local_rank,
    }
    missing = [name for name, given in needed.items() if given is None and name not in env]
    if missing:
        raise RuntimeError(
            f"bridge_mr.distributed.initialize: the torchrun variable(s) {', '.join(missing)} "
            f"are not set, so this process does not know its place among the others. Fix: start "
            f"the program with torchrun (`torchrun --nproc-per-node=2 train.py`, or `python -m "
            f"torch.distributed.run ...`), or pass the matching arguments (coordinator_address, "
            f"num_processes, process_id, local_rank)."
        )
    world = num_processes if num_processes is not None else _integer(env, "WORLD_SIZE")
    rank = process_id if process_id is not None else _integer(env, "RANK")
    local = local_rank if local_rank is not None else _integer(env, "LOCAL_RANK")
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(
            f"bridge_mr.distributed.initialize: expected 0 <= rank < world_size and local_rank "
            f">= 0, got rank={rank}, world_size={world}, local_rank={local}."
        )
    if coordinator_address is None:
        port = (
            _integer(env, "BRIDGE_MR_COORDINATOR_PORT")
            if "BRIDGE_MR_COORDINATOR_PORT" in env
            else _integer(env, "MASTER_PORT") + 1
        )
        coordinator_address = f"{env['MASTER_ADDR']}:{port}"
    if check_replicas is None:
        check_replicas = env.get("BRIDGE_MR_CHECK_REPLICAS", "0") not in ("", "0")
    if local_device_ids is None and _cuda_plugin_installed():
        local_device_ids = [local]
    process = Process(rank, world, local, coordinator_address, check_replicas)
    with _LOCK:
        if _STARTED:
            if _STARTED[0] != process:
                raise RuntimeError(
                    f"bridge_mr.distributed.initialize: this process already connected as "
                    f"{_STARTED[0]}; it cannot connect again as {process}."
                )
            return _STARTED[0]
        if rank == 0:
            _check_port_free(coordinator_address)
        try:
            jax.distributed.initialize(
                coordinator_address,
                num_processes=world,
                process_id=rank,
                initialization_timeout=initialization_timeout_seconds,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                local_device_ids=local_device_ids,
            )
        except RuntimeError as error:
            if "before any JAX computation" not in str(error):
                raise
            raise RuntimeError(
                f"bridge_mr.distributed.initialize: jax.distributed could not start ({error}). "
                f"It must run before this process's first JAX computation: call "
                f"bridge_mr.distributed.initialize() at the top of the program."
            ) from error
        _STARTED.append(process)
        return process


def current() -> Process | None:
    """The process `initialize` connected, or None where it has not run (one process).

    Returns:
      The `Process` `initialize` returned, or None.

    Example:
      >>> process = bridge_mr.distributed.current()
      >>> print(process)  # one process: initialize has not run
      None
      >>> rank = 0 if process is None else process.rank
    """
    return _STARTED[0] if _STARTED else None


def _cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (found without importing or starting it)."""
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")
    )


def _check_port_free(address: str) -> None:
    """Fails clearly where rank 0's coordination service could not listen (JAX would crash)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"bridge_mr.distributed.initialize: expected the coordinator address to end in a "
            f"port between 1 and 65535, got {address!r}. Fix: set BRIDGE_MR_COORDINATOR_PORT or "
            f"MASTER_PORT to a valid port."
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the coordination service binds: a port a finished job left in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("", int(port)))
    except OSError as error:
        raise RuntimeError(
            f"bridge_mr.distributed.initialize: rank 0 cannot serve JAX's coordination service "
            f"on port {port} of {host or 'this host'} ({error}). Fix: set "
            f"BRIDGE_MR_COORDINATOR_PORT to a free port (the same on every process), or pass "
            f"coordinator_address."
        ) from None


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"bridge_mr.distributed.initialize: expected the environment variable {name} to be "
            f"an integer, got {value!r}."
        ) from None
