"""One program over every process's clients: the layout of per-rank data in global arrays.

Each rank holds its own clients. `agree` exchanges, in one small collective, what every rank is
about to run (its client count and a fingerprint of the call) and refuses a mismatch on every
rank alike, before the program's own collectives could deadlock on it. The agreed `Layout`
places rank r's clients at rows [r * slot, r * slot + counts[r]) of the global clients axis
(`slot` is the largest count, rounded up to a multiple of the process's device count); the rows
after a rank's own clients are padding, which the program masks out.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._initialize import current

__all__ = [
    "Layout",
    "agree",
    "agree_minimum",
    "agree_seconds",
    "constrain",
    "global_array",
    "local_part",
    "multi_process",
    "slot_for",
]

# The exchanged facts: [count, replica check on, signature hash (2), replica hash (2)], then
# the call's description (UTF-8, for the error that names what each rank ran).
_HEAD = 6
_DESCRIPTION_BYTES = 384


def multi_process() -> bool:
    """Whether `bridge_mr.distributed.initialize` connected this process to others.

    (A plain read: `torch.compile` may trace it, where it would warn about
    `jax.process_count`'s cache.)

    Returns:
      True where `initialize` connected two processes or more.

    Example:
      >>> bridge_mr.distributed.multi_process()  # one process: initialize has not run
      False
    """
    process = current()
    return process is not None and process.world_size > 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each rank's clients sit on the global clients axis (a static, hashable value).

    Attributes:
      counts: every rank's client count, by rank.
      slot: the rows each rank holds (its count, padded; a multiple of its device count).
      rank: this process's rank.
      placement: the name of the clients axis (of the global mesh).
      per_rank: the names of the call's arguments whose tensors are this rank's own (their
        leading axis is the clients axis); the other tensors are the same on every rank.

    Example:
      >>> layout = bridge_mr.distributed.Layout(counts=(3, 5), slot=5, rank=0)
      >>> layout.world_size, layout.total, layout.padded
      (2, 8, True)
    """

    counts: tuple[int, ...]
    slot: int
    rank: int
    placement: str = "clients"
    per_rank: tuple[str, ...] = ("clients", "weights")

    @property
    def world_size(self) -> int:
        """How many processes."""
        return len(self.counts)

    @property
    def total(self) -> int:
        """The number of real clients over every rank."""
        return sum(self.counts)

    @property
    def padded(self) -> bool:
        """Whether some rank holds padding rows."""
        return any(c != self.slot for c in self.counts)

    def mask(self) -> np.ndarray:
        """[world_size * slot] bools: True at real clients, False at padding.

        Returns:
          A numpy bool array of shape [world_size * slot].

        Example:
          >>> layout = bridge_mr.distributed.Layout(counts=(3, 5), slot=5, rank=0)
          >>> layout.mask()  # rank 0's 3 clients and 2 padding rows, then rank 1's 5 clients
          array([ True,  True,  True, False, False,  True,  True,  True,  True,  True])
        """
        return np.concatenate([np.arange(self.slot) < c for c in self.counts])

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a per-rank array whose local shape is `local_shape`.

        Args:
          local_shape: the shape of this rank's part, clients axis first.

        Returns:
          The shape with the clients axis `world_size * slot` long.

        Example:
          >>> layout = bridge_mr.distributed.Layout(counts=(3, 5), slot=5, rank=0)
          >>> layout.global_shape((3, 4))
          (10, 4)
        """
        return (self.world_size * self.slot, *local_shape[1:])

    @property
    def mesh(self) -> Mesh:
        """Every process's devices, rank by rank, along one Auto axis named `placement`."""
        return _global_mesh(self.placement)


@functools.cache
def _global_mesh(placement: str) -> Mesh:
    return Mesh(np.array(_devices()), (placement,), axis_types=(AxisType.Auto,))


def _devices() -> list[Any]:
    """The devices the cross-process program runs on, rank by rank.

    On CPU, one per process: a process's CPU devices share its cores, and each is a peer of
    its own in gloo's collectives, so more of them only add participants to every all-reduce.
    On accelerators, every device of every process.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if devices[0].platform != "cpu":
        return devices
    first: dict[int, Any] = {}
    for device in devices:
        first.setdefault(device.process_index, device)
    return list(first.values())


def slot_for(counts: Sequence[int]) -> int:
    """The rows per rank for these counts: the largest, up to a multiple of its devices.

    Args:
      counts: every rank's client count.

    Returns:
      `Layout.slot` for these counts.

    Example:
      >>> bridge_mr.distributed.slot_for([3, 5])  # on CPU: one device per process
      5
    """
    local = len(_devices()) // jax.process_count()
    return math.ceil(max(counts) / local) * local


def agree(
    count: int,
    signature: str,
    replica_hashes: Sequence[bytes] | None,
    replica_names: Sequence[str],
    *,
    where: str,
) -> tuple[int, ...]:
    """Exchanges this rank's facts with every other rank; returns every rank's client count.

    Every rank must call it at the same point (each `map_reduce` call does, once). Every rank
    raises the same error when the ranks disagree, so none is left waiting in a collective.

    Args:
      count: this rank's client count.
      signature: the call as this rank sees it (function, shapes, dtypes, options), in words:
        ranks whose signatures differ would run different programs.
      replica_hashes: with the replica check on, a hash of each tensor that every rank must
        hold equal (the server's); None with it off.
      replica_names: what errors call those tensors.
      where: the caller, for error messages ("map_reduce").

    Returns:
      Every rank's client count, by rank.

    Raises:
      RuntimeError: the ranks run different calls, hold different replicas (with the check
        on), or some rank has no clients.

    Example:
      >>> bridge_mr.distributed.agree(3, "map_reduce(loss, ...)", None, (), where="map_reduce")
      (3,)
    """
    digest = hashlib.blake2b(signature.encode(), digest_size=8).digest()
    combined = hashlib.blake2b(b"".join(replica_hashes or ()), digest_size=8).digest()
    description = signature.encode()[:_DESCRIPTION_BYTES].ljust(_DESCRIPTION_BYTES, b"\0")
    head = np.array(
        [count, replica_hashes is not None, *_words(digest), *_words(combined)], np.int32
    )
    facts = np.concatenate([head, np.frombuffer(description, np.uint8).astype(np.int32)])
    table = np.asarray(multihost_utils.process_allgather(facts)).reshape(-1, facts.size)
    signatures = [bytes(row[_HEAD:].astype(np.uint8)).rstrip(b"\0").decode() for row in table]
    if len({tuple(row[2:4]) for row in table}) > 1:
        lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(signatures))
        raise RuntimeError(
            f"{where}: the ranks called it with different programs or signatures (or one "
            f"rank made more calls than another), so they cannot run one program together:"
            f"\n{lines}\nFix: every rank must make the same calls in the same order, with the "
            f"same function, server tensors (shapes, dtypes, requires_grad), client tensors "
            f"(shapes after the clients axis) and options."
        )
    counts = tuple(int(c) for c in table[:, 0])
    if min(counts) < 1:
        raise RuntimeError(
            f"{where}: every rank needs at least one client; the client counts by rank are "
            f"{list(counts)}. Fix: give each rank some clients (or run fewer processes)."
        )
    checks = {bool(c) for c in table[:, 1]}
    if checks == {True} and len({tuple(row[4:6]) for row in table}) > 1:
        _name_differing_replicas(replica_hashes or (), replica_names, where)
    return counts


def _name_differing_replicas(hashes: Sequence[bytes], names: Sequence[str], where: str) -> None:
    mine = np.array([_words(h[:8]) for h in hashes], np.int32).reshape(-1, 2)
    table = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, *mine.shape)
    differing = []
    for i, name in enumerate(names):
        others = [r for r in range(len(table)) if (table[r, i] != table[0, i]).any()]
        if others:
            differing.append(f"{name} differs from rank 0's on rank(s) {others}")
    raise RuntimeError(
        f"{where}: server tensors differ between ranks (bridge_mr.distributed.initialize("
        f"check_replicas=True)): {'; '.join(differing)}. Every rank must hold the same server "
        f"values, as with DDP: initialise the model from the same seed (or broadcast rank 0's "
        f"parameters once), and step it only with the gradients map_reduce returns."
    )


def agree_seconds(seconds: float) -> float:
    """The longest of every rank's `seconds` (a timing all ranks then decide on alike).

    Args:
      seconds: this rank's timing.

    Returns:
      The largest of every rank's `seconds` (as a float32 exchanged them).

    Example:
      >>> bridge_mr.distributed.agree_seconds(1.5)  # one process: its own
      1.5
    """
    table = multihost_utils.process_allgather(np.array([seconds], np.float32))
    return float(np.max(np.asarray(table)))


def agree_minimum(value: int) -> int:
    """The smallest of every rank's non-negative `value` (below 2**62; a byte count).

    Exchanged as two int32 words: with JAX's x64 mode off a gathered int64 would be narrowed.

    Args:
      value: this rank's value, 0 <= value < 2**62.

    Returns:
      The smallest of every rank's `value`.

    Example:
      >>> bridge_mr.distributed.agree_minimum(3 * 2**40)  # one process: its own, past int32
      3298534883328
    """
    words = np.array([value >> 31, value & 0x7FFFFFFF], np.int32)
    table = np.asarray(multihost_utils.process_allgather(words)).reshape(-1, 2).astype(np.int64)
    return int(np.min((table[:, 0] << 31) | table[:, 1]))


def _words(digest: bytes) -> list[int]:
    return np.frombuffer(digest[:8], np.int32).tolist()


def global_array(local: jax.Array | np.ndarray, layout: Layout, *, per_rank: bool) -> jax.Array:
    """The global array of this rank's `local` part: its clients' rows, or its replica.

    Per-rank arrays are sharded over every process's devices along the clients axis; the
    others are replicated (every rank's copy must be equal).

    Args:
      local: this rank's part: its clients' rows (per-rank), or its copy.
      layout: the agreed `Layout`.
      per_rank: whether `local` holds this rank's own clients (else a replica).

    Returns:
      The global array, on `layout.mesh`.

    Example:
      >>> layout = bridge_mr.distributed.Layout(counts=(3,), slot=3, rank=0)  # one process
      >>> rows = bridge_mr.distributed.global_array(np.ones((3, 2), np.float32), layout,
      ...                                           per_rank=True)
      >>> rows.shape, tuple(rows.sharding.spec)  # sharded along the clients axis
      ((3, 2), ('clients',))
    """
    mesh = layout.mesh
    if per_rank:
        sharding = NamedSharding(mesh, P(layout.placement))
        shape = layout.global_shape(local.shape)
    else:
        sharding = NamedSharding(mesh, P())
        shape = tuple(local.shape)
    return jax.make_array_from_process_local_data(sharding, local, shape)


def constrain(array: jax.Array, layout: Layout, *, per_rank: bool) -> jax.Array:
    """Inside a program: `array` sharded along the clients axis (per-rank) or replicated.

    Args:
      array: a traced global array.
      layout: the agreed `Layout`.
      per_rank: whether `array` has the clients axis first (else it is replicated).

    Returns:
      `array`, with the sharding constraint.

    Example:
      >>> layout = bridge_mr.distributed.Layout(counts=(3,), slot=3, rank=0)  # one process
      >>> double = jax.jit(lambda a: bridge_mr.distributed.constrain(2 * a, layout, per_rank=True))
      >>> double(jnp.arange(3.0))  # the rows are laid out along the clients axis in the program
      Array([0., 2., 4.], dtype=float32)
    """
    spec = P(layout.placement) if per_rank else P()
    return jax.lax.with_sharding_constraint(array, NamedSharding(layout.mesh, spec))


def local_part(array: jax.Array, *, per_rank: bool) -> jax.Array:
    """This process's part of a global array: its rows (per-rank) or one replica.

    Args:
      array: a global array, e.g. a program's result.
      per_rank: whether `array` is sharded along the clients axis (else it is replicated).

    Returns:
      This process's rows (per-rank), or its copy, on one of its devices.

    Example:
      >>> layout = bridge_mr.distributed.Layout(counts=(3,), slot=3, rank=0)  # one process
      >>> rows = bridge_mr.distributed.global_array(np.ones((3, 2), np.float32), layout,
      ...                                           per_rank=True)
      >>> bridge_mr.distributed.local_part(rows, per_rank=True)
      Array([[1., 1.],
             [1., 1.],
             [1., 1.]], dtype=float32)
    """
    if not per_rank:
        return array.addressable_data(0)
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    if len(shards) == 1:
        return shards[0].data
    first = shards[0].data.device
    return jnp.concatenate([jax.device_put(s.data, first) for s in shards])
