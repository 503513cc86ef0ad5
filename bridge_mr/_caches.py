"""The registry of bridge_mr's module-level caches, which `bridge_mr.clear_caches()` walks.

Every module-level cache (a dict of traces, plans, compiled segments...) registers how to empty
itself here when its module is imported, so that `clear_caches()` reaches it without knowing the
module, and a test (`tests/test_caches_registry.py`) fails on a module-level cache that did not
register. Imports only the standard library.

    _PLANS = register("beam plans", weakref.WeakKeyDictionary())  # cleared by clear_caches()
    _TRACES = register("client traces", Bounded(64))  # at most 64 entries, oldest out first

`Bounded` is the one way bridge_mr bounds a cache (module-level or per object).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "CACHE_DIR",
    "Bounded",
    "Clearable",
    "clear_all",
    "disk_root",
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
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

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


class Bounded(dict[K, V], Generic[K, V]):
    """A dict of at most `maxsize` entries: `put` drops the oldest to make room.

    Reads are the dict's own (`get`, `in`, `[]`: no Python call on a hot path); `put` adds an
    entry (moving an existing key to the newest place) and drops the oldest beyond `maxsize`,
    calling `on_drop(key)` for each; `use` reads an entry and makes it the newest (least
    recently used out first, for callers that want that). Writes are thread-safe.

    Args:
      maxsize: the most entries it holds (at least 1).
      on_drop: called with each key `put` drops (e.g. to drop it from a related cache too).

    Raises:
      ValueError: `maxsize` is below 1.

    Example:
      >>> cache = Bounded(2)
      >>> for key in "abc":
      ...     _ = cache.put(key, key.upper())
      >>> sorted(cache), cache.get("c")
      (['b', 'c'], 'C')
    """

    def __init__(self, maxsize: int, on_drop: Callable[[K], None] | None = None) -> None:
        super().__init__()
        if maxsize < 1:
            raise ValueError(f"Bounded(maxsize=...): expected at least 1; got {maxsize!r}.")
        self.maxsize = maxsize
        self._on_drop = on_drop
        self._lock = threading.RLock()

    def put(self, key: K, value: V) -> V:
        """Stores `value` under `key` as the newest entry, dropping the oldest beyond
        `maxsize`; returns `value`."""
        dropped = []
        with self._lock:
            self.pop(key, None)
            while len(self) >= self.maxsize:
                oldest = next(iter(self))
                del self[oldest]
                dropped.append(oldest)
            self[key] = value
        if self._on_drop is not None:
            for oldest in dropped:
                self._on_drop(oldest)
        return value

    def use(self, key: K) -> V | None:
        """The value under `key` (now the newest entry), or None."""
        with self._lock:
            if key not in self:
                return None
            value = self.pop(key)
            self[key] = value
            return value

    def clear(self) -> None:
        """Drops every entry (no `on_drop` call)."""
        with self._lock:
            super().clear()


def disk_root() -> Path:
    """bridge_mr's cache directory on disk (read at each call): `$BRIDGE_MR_CACHE_DIR`, else
    `$XDG_CACHE_HOME/bridge_mr`, else `~/.cache/bridge_mr`. What is kept there (auto's
    decisions, compiled programs) lives in a folder of its own; `clear_all` deletes none of it."""
    root = os.environ.get(CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "bridge_mr") if xdg else os.path.expanduser("~/.cache/bridge_mr")
    return Path(root)
