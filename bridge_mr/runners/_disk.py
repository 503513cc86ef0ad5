"""bridge_mr's compiled programs on disk, so that the next process loads them instead of compiling.

Like torch.compile's on-disk cache: a DLPack runner's program, lowered for its first call's
arguments, is looked up by a hash of everything its compiled form depends on (the lowered
StableHLO text, the compiler options, the devices' platform and kind, the CPU's model and
features, the versions of jax and jaxlib, the format); a hit is loaded
(`jax.experimental.serialize_executable`), a miss is compiled and, when compiling took at least
`MIN_COMPILE_SECONDS`, written. One file per program under `directory()`:

* `$BRIDGE_MR_CACHE_DIR/xla`, else `$XDG_CACHE_HOME/bridge_mr/xla`, else
  `~/.cache/bridge_mr/xla`;
* none at all (the program is compiled by `jax.jit` as before) when
  `$BRIDGE_MR_COMPILATION_CACHE` is `0`, or when JAX's own persistent compilation cache is
  configured (`jax_compilation_cache_dir`): the user's configuration wins, and caches bridge_mr's
  programs too. Both are read at each program's first call.

Only this: no JAX config is changed, and the user's own programs are not cached. Reading or
writing never fails a call: a missing, unreadable, corrupt or unloadable file reads as a miss
(compiled again and rewritten), an unwritable directory as a program not kept, a program that
cannot be serialized as one compiled in memory. Writes are atomic (a temporary file renamed into
place). `bridge_mr.clear_caches()` does not delete the files; deleting the directory does.
Loading a file runs code compiled by XLA: the directory must be as trusted as the user's own
cache directory.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from bridge_mr import _caches

#: The environment variable that turns the compiled programs on disk off ("0").
SWITCH = "BRIDGE_MR_COMPILATION_CACHE"
#: Programs that compile faster than this are not written (reading costs about a millisecond).
MIN_COMPILE_SECONDS = 0.2
#: The format of the files; another format reads as a miss.
FORMAT = 1

_LOG = logging.getLogger("bridge_mr")


def directory() -> Path | None:
    """Where compiled programs are kept, or None where they are not (see the module).

    Returns:
      The directory (it may not exist yet).
    """
    if os.environ.get(SWITCH, "1") == "0" or getattr(jax.config, "jax_compilation_cache_dir", None):
        return None
    return _caches.disk_root() / "xla"


def compiled(
    jitted: Any, args: Sequence[Any], options: Mapping[str, str] | None, folder: Path
) -> Callable[..., Any]:
    """`jitted` compiled for `args`: loaded from `folder`, or compiled (and written there).

    Args:
      jitted: a `jax.jit` function (with `options` as its compiler options, if any).
      args: the arguments of its first call (arrays).
      options: its compiler options, part of the key.
      folder: `directory()`.

    Returns:
      The compiled program (`jax.stages.Compiled`), called as `jitted` is.
    """
    lowered = jitted.lower(*args)
    path = folder / f"{_key(lowered.as_text(), options, args)}.bin"
    loaded = _load(path, args)
    if loaded is not None:
        return loaded
    start = time.perf_counter()
    program = lowered.compile()
    devices = _assignment(program)
    if devices is not None and time.perf_counter() - start >= MIN_COMPILE_SECONDS:
        _store(path, program, devices)
    return program


def _assignment(program: Any) -> list[int] | None:
    """The ids of the devices `program` runs on, in its order; None where not known (a program
    with no array input, or an input sharding of another kind)."""
    shardings = jax.tree.leaves(program.input_shardings)
    if not shardings:
        return None
    first = shardings[0]
    if isinstance(first, jax.sharding.NamedSharding) and isinstance(first.mesh, jax.sharding.Mesh):
        return [d.id for d in first.mesh.devices.flat]
    if isinstance(first, jax.sharding.SingleDeviceSharding):
        return [d.id for d in first.device_set]
    return None


def _key(text: str, options: Mapping[str, str] | None, args: Sequence[Any]) -> str:
    devices = {d for a in args if isinstance(a, jax.Array) for d in a.devices()}
    kinds = sorted({(d.platform, d.device_kind) for d in devices})
    parts = [
        str(FORMAT),
        jax.__version__,
        _jaxlib_version(),
        repr(sorted((options or {}).items())),
        repr(kinds),
        repr(sorted(d.id for d in devices)),
        _host() if any(platform_ == "cpu" for platform_, _ in kinds) else "",
        text,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.cache
def _jaxlib_version() -> str:
    return metadata.version("jaxlib")


@functools.cache
def _host() -> str:
    """The CPU a CPU program is compiled for: its model and features (never shared across)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _load(path: Path, args: Sequence[Any]) -> Any | None:
    try:
        with open(path, "rb") as f:
            record = pickle.load(f)
        if record.get("format") != FORMAT:
            return None
        backend = _backend(args)
        by_id = {d.id: d for d in backend.devices()}
        return serialize_executable.deserialize_and_load(
            record["executable"],
            record["in_tree"],
            record["out_tree"],
            backend=backend,
            execution_devices=[by_id[i] for i in record["devices"]],
        )
    except FileNotFoundError:
        return None
    except Exception as err:  # Corrupt, another jaxlib's, unloadable: compile again.
        _LOG.debug("bridge_mr: compiled program %s not loaded (%s); compiling it", path, err)
        return None


def _backend(args: Sequence[Any]) -> Any:
    for a in args:
        if isinstance(a, jax.Array):
            return next(iter(a.devices())).client
    return jax.devices()[0].client


def _store(path: Path, program: Any, devices: list[int]) -> None:
    temporary = None
    try:
        executable, in_tree, out_tree = serialize_executable.serialize(program)
        record = {
            "format": FORMAT,
            "executable": executable,
            "in_tree": in_tree,
            "out_tree": out_tree,
            "devices": devices,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "wb") as f:
            pickle.dump(record, f)
        os.replace(temporary, path)
    except Exception as err:  # Not serializable here, or the directory is not writable.
        _LOG.debug("bridge_mr: compiled program %s not written (%s)", path, err)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
