"""A bounded, thread-safe mapping that forgets its least recently used entry (standard library only,
so the worker code can use it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A mapping of at most `maxsize` entries; storing one more drops the least recently used.

    Args:
        maxsize: The most entries it holds.

    Raises:
        ValueError: `maxsize` is below 1.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"LRU: maxsize must be at least 1; got {maxsize}.")
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value stored under `key` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Stores `value` under `key`, dropping the least recently used entry when full."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drops every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
