"""Conversion counters: how many tensors crossed the boundary and how many needed a copy."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

# The converters test this list's truthiness on their hot path, so it is only ever mutated in
# place (never rebound) and stays empty unless a `count_conversions` block is open.
ACTIVE: list[ConversionStats] = []
_LOCK = threading.Lock()


@dataclasses.dataclass
class ConversionStats:
    """Totals recorded while a `count_conversions` block was open.

    Attributes:
      imports: torch tensors converted to JAX arrays.
      exports: JAX arrays converted to torch tensors.
      copies: conversions that had to copy the data instead of sharing it.
      bytes_copied: bytes written by those copies.
    """

    imports: int = 0
    exports: int = 0
    copies: int = 0
    bytes_copied: int = 0


@contextlib.contextmanager
def count_conversions() -> Iterator[ConversionStats]:
    """Counts every conversion made by `bridge_mr.dlpack`, in any thread, inside the block.

    Blocks may nest; each one sees the conversions made while it is open.

    Example:
      >>> with count_conversions() as stats:
      ...     arrays = to_jax(tensors)
      >>> assert stats.copies == 0
    """
    stats = ConversionStats()
    with _LOCK:
        ACTIVE.append(stats)
    try:
        yield stats
    finally:
        with _LOCK:
            ACTIVE.remove(stats)


def record(*, imports: int = 0, exports: int = 0, copies: int = 0, bytes_copied: int = 0) -> None:
    """Adds to every open `count_conversions` block."""
    with _LOCK:
        for stats in ACTIVE:
            stats.imports += imports
            stats.exports += exports
            stats.copies += copies
            stats.bytes_copied += bytes_copied
