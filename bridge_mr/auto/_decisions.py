"""`auto`'s decisions on disk, so that the next process does not decide again.

One small JSON file per decision, named by a hash of everything the decision depends on (the
client function's jaxpr, the round's shapes and dtypes, reduction, placement, gradients, device
kind, the versions of jax, jaxlib, torch and bridge_mr, auto's tuning constants), under
`directory()`:

* `$BRIDGE_MR_CACHE_DIR/auto`, else `$XDG_CACHE_HOME/bridge_mr/auto`, else
  `~/.cache/bridge_mr/auto`;
* none at all (nothing read or written) when `$BRIDGE_MR_AUTO_DISK` is `0`. Both variables are
  read at each decision, so setting `os.environ` in code works as well as in the shell.

Reading or writing never fails a call: a missing, unreadable or corrupt file reads as no
decision (auto decides again and rewrites it), an unwritable directory as a decision not kept.
Writes are atomic (a temporary file renamed into place), so concurrent processes never read half
a file. `bridge_mr.clear_caches()` does not delete these files (they hold no program or user
value, and a changed function or version gets another name): `forget_all()`, or deleting the
directory, does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import torch

from bridge_mr import _caches
from bridge_mr.typing import PyTree

from . import settings
from ._device import DeviceDescription

#: The environment variable that turns the decisions on disk off ("0").
DISK_SWITCH = "BRIDGE_MR_AUTO_DISK"
#: The format of the files; another format reads as no decision.
FORMAT = 1

_LOG = logging.getLogger("bridge_mr")


def directory() -> Path | None:
    """Where decisions are kept, or None when `$BRIDGE_MR_AUTO_DISK` is "0" (see the module).

    Returns:
      The directory (it may not exist yet).

    Example:
      >>> import os
      >>> where = bridge_mr.auto.directory()  # under $BRIDGE_MR_CACHE_DIR here
      >>> str(where) == os.path.join(os.environ["BRIDGE_MR_CACHE_DIR"], "auto")
      True
    """
    if os.environ.get(DISK_SWITCH, "1") == "0":
        return None
    return _caches.disk_root() / "auto"


def name(parts: Mapping[str, Any]) -> str:
    """The file name of the decision that depends on `parts` (JSON-able values)."""
    text = json.dumps(dict(parts), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest() + ".json"


def fingerprint(
    jaxpr: Any,
    args: tuple[Any, ...],
    specs: tuple[PyTree, ...],
    tensors: Sequence[torch.Tensor],
    budget: int | None,
    device: DeviceDescription,
) -> dict[str, Any]:
    """Everything a decision depends on (`settings` and the device included), for its name on
    disk."""
    _, _, _, _, reduce, placement, mesh = args
    return {
        "jaxpr": hashlib.sha256(str(jaxpr).encode()).hexdigest(),
        "round": [reduce, placement, repr(mesh), jax.tree.map(repr, specs)],
        "grads": [torch.is_grad_enabled() and t.requires_grad for t in tensors],
        "budget": budget,
        "device": [dataclasses.astuple(device), jax.devices()[0].device_kind, os.cpu_count()],
        "versions": [_version(p) for p in ("jax", "jaxlib", "torch", "bridge_mr")],
        "config": [getattr(jax.config, n) for n in ("jax_enable_x64", "jax_numpy_dtype_promotion")],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "constants": settings.as_read_now(),
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load(file_name: str) -> dict[str, Any] | None:
    """The decision kept under `file_name`, or None (none kept, disk off, unreadable, corrupt)."""
    where = directory()
    if where is None:
        return None
    try:
        record = json.loads((where / file_name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        _LOG.debug("map_reduce(strategy='auto'): ignoring %s: %s", where / file_name, err)
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        _LOG.debug("map_reduce(strategy='auto'): ignoring %s: not a decision", where / file_name)
        return None
    return record


def store(file_name: str, record: Mapping[str, Any]) -> None:
    """Keeps `record` under `file_name`, atomically; an unwritable directory keeps nothing."""
    where = directory()
    if where is None:
        return
    temporary = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=where, prefix=".tmp-", suffix=".json", delete=False
        ) as out:
            temporary = out.name
            json.dump({**record, "format": FORMAT}, out)
        os.replace(temporary, where / file_name)
    except (OSError, TypeError, ValueError) as err:
        _LOG.debug("map_reduce(strategy='auto'): decision not kept in %s: %s", where, err)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def forget_all() -> int:
    """Deletes every decision kept on disk (in `directory()`).

    Returns:
      How many files were deleted.

    Example:
      >>> bridge_mr.map_reduce(jax_loss, params, batch).backward()  # decides, keeps it on disk
      >>> bridge_mr.auto.forget_all() >= 1  # the next process decides again
      True
    """
    where = directory()
    if where is None or not where.is_dir():
        return 0
    deleted = 0
    for path in where.glob("*.json"):
        try:
            path.unlink()
            deleted += 1
        except OSError:
            continue
    return deleted
