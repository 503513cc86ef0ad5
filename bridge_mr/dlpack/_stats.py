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

    Example:
      >>> with bridge_mr.dlpack.count_conversions() as stats:
      ...     _ = bridge_mr.dlpack.to_jax(torch.ones(3))  # contiguous: shared, not copied
      >>> stats
      ConversionStats(imports=1, exports=0, copies=0, bytes_copied=0)
    """

    imports: int = 0
    exports: int = 0
    copies: int = 0
    bytes_copied: int = 0


@contextlib.contextmanager
def count_conversions() -> Iterator[ConversionStats]:
    """Counts every conversion made by `bridge_mr.dlpack`, in any thread, inside the block.

    Blocks may nest; each one sees the conversions made while it is open.

    Yields:
      The block's `ConversionStats`, updated as conversions happen.

    Example:
      >>> from bridge_mr.dlpack import count_conversions, to_jax
      >>> x = torch.arange(16.0).reshape(4, 4)
      >>> with count_conversions() as stats:
      ...     shared = to_jax(x)  # contiguous: shared
      ...     with count_conversions() as inner:
      ...         copied = to_jax(x[:, ::2])  # every other column: one copy of 8 floats
      >>> stats.imports, stats.copies, stats.bytes_copied, inner.imports
      (2, 1, 32, 1)
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
