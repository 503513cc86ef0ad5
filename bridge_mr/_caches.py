"""The registry of bridge_mr's module-level caches, which `bridge_mr.clear_caches()` walks.

Every module-level cache (a dict of traces, plans, compiled segments...) registers how to empty
itself here when its module is imported, so that `clear_caches()` reaches it without knowing the
module, and a test (`tests/test_caches_registry.py`) fails on a module-level cache that did not
register. Imports only the standard library.

    _PLANS = register("beam plans", weakref.WeakKeyDictionary())  # cleared by clear_caches()
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

__all__ = [
    "CACHE_DIR",
    "Clearable",
    "clear_all",
    "disk_root",
    "make_room",
    "register",
    "register_clear",
    "registered",
]

#: The environment variable naming bridge_mr's cache directory on disk.
CACHE_DIR = "BRIDGE_MR_CACHE_DIR"


class Clearable(Protocol):
    """A cache that empties itself: a dict, a weak dictionary, a set, a list."""

    def clear(self) -> None: ...


C = TypeVar("C", bound=Clearable)
D = TypeVar("D", bound=dict[Any, Any])

_LOCK = threading.Lock()
_CLEARS: dict[str, Callable[[], None]] = {}
_OBJECTS: dict[str, object] = {}


def register(name: str, cache: C) -> C:
    """Registers a module-level cache object under `name`; returns the cache.

    Args:
      name: what the cache holds, unique across bridge_mr (e.g. "beam plans").
      cache: the container; `clear_caches()` calls its `clear()`.

    Returns:
      `cache` itself, so that a module writes `_CACHE = register("...", {})`.

    Raises:
      ValueError: another cache is registered under `name`.
    """
    register_clear(name, cache.clear)
    with _LOCK:
        _OBJECTS[name] = cache
    return cache


def register_clear(name: str, clear: Callable[[], None]) -> None:
    """Registers how to empty a cache that is not one container (e.g. a set of objects whose
    `clear_cache()` each must be called).

    Args:
      name: what the cache holds, unique across bridge_mr.
      clear: empties it; called by `clear_caches()`.

    Raises:
      ValueError: another cache is registered under `name`.
    """
    with _LOCK:
        previous = _CLEARS.get(name)
        if previous is not None and previous != clear:
            raise ValueError(f"bridge_mr: a cache named {name!r} is registered already.")
        _CLEARS[name] = clear


def registered() -> dict[str, Any]:
    """The registered caches by name: the container (or the clear function) of each."""
    with _LOCK:
        return {name: _OBJECTS.get(name, clear) for name, clear in _CLEARS.items()}


def clear_all() -> None:
    """Empties every registered cache (in registration order)."""
    with _LOCK:
        clears = list(_CLEARS.values())
    for clear in clears:
        clear()


def make_room(cache: D, bound: int) -> D:
    """Drops `cache`'s oldest entries (dicts keep insertion order) until one more fits `bound`.

    Args:
      cache: a dict used as a bounded cache.
      bound: the most entries it may hold.

    Returns:
      `cache` itself, so that a module writes `make_room(_CACHE, 256)[key] = value`.
    """
    while cache and len(cache) >= bound:
        del cache[next(iter(cache))]
    return cache


def disk_root() -> Path:
    """bridge_mr's cache directory on disk (read at each call): `$BRIDGE_MR_CACHE_DIR`, else
    `$XDG_CACHE_HOME/bridge_mr`, else `~/.cache/bridge_mr`. What is kept there (auto's
    decisions, compiled programs) lives in a folder of its own; `clear_all` deletes none of it."""
    root = os.environ.get(CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "bridge_mr") if xdg else os.path.expanduser("~/.cache/bridge_mr")
    return Path(root)
