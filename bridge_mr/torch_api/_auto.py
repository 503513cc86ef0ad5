"""`map_reduce(strategy="auto")`: measure the strategies once per signature, keep the fastest.

For a call signature (the compile key without the strategy), `choose` estimates each candidate's
memory from its compiled program (`memory_analysis()`), skips those over the budget, times the
rest on the call's own tensors (forward and backward, without touching `.grad`), and keeps vmap
unless another is clearly faster. The tuning constants below are read at each measurement;
`map_reduce_choices` lists what was picked and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import _caches, distributed, jax_core
from bridge_mr._compat import torch as torch_compat
from bridge_mr.dlpack import tensor_avals

from . import _signature
from ._function import TorchFunction
from ._round import Measured, PyTree

#: The chunk sizes `auto` tries (those below the number of clients).
AUTO_CHUNK_SIZES: tuple[int, ...] = (16, 128)
#: Timed calls per candidate after one untimed call (which traces and compiles).
AUTO_REPEATS = 3
#: A candidate whose first timed call takes over this multiple of the fastest first timed call
#: is not timed again: it cannot win.
AUTO_GIVE_UP = 2.0
#: A candidate replaces vmap only when its median time is below this fraction of vmap's.
AUTO_MARGIN = 0.9
#: A call for which vmap takes less (seconds) keeps vmap without trying the others: no more
#: than this per call to gain, against a few compilations to find out.
AUTO_MIN_SECONDS = 0.005
#: Without `memory_budget_bytes`, a candidate XLA estimates to need over this many times the
#: leanest candidate's memory, and over `AUTO_MEMORY_FLOOR` bytes, is not run: measuring it
#: would set the process's peak memory (vmap of a CNN round at 50 clients: 4x the torch loop's).
AUTO_MEMORY_FACTOR = 4
AUTO_MEMORY_FLOOR = 1 << 30
_MAX_CHOICES = 256

_LOG = logging.getLogger("bridge_mr")
_TOO_FAST = "not tried: vmap takes under AUTO_MIN_SECONDS"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy `auto` considered for a signature, with what it measured.

    Attributes:
      strategy: "vmap", "per_client" or "chunks".
      chunk_size: the chunk size for "chunks", else None.
      memory_bytes: XLA's estimate of the memory the call needs (arguments, outputs and
        temporaries of the forward program, with the backward pass when gradients are
        needed), or None where the backend reports none.
      seconds: the median of the timed calls, or None when it was not timed.
      skipped: why it was not timed ("" when it was).
      timed_calls: how many calls were timed: `AUTO_REPEATS`, or one when the first took over
        `AUTO_GIVE_UP` times the fastest candidate's first.
    """

    strategy: Measured
    chunk_size: int | None
    memory_bytes: int | None
    seconds: float | None
    skipped: str = ""
    timed_calls: int = 0


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `map_reduce(strategy="auto")` picked for one signature, and the measurements.

    Attributes:
      signature: the call it was made for, in words (function, shapes, dtypes, reduction).
      strategy: the strategy picked.
      chunk_size: its chunk size ("chunks"), else None.
      reason: why it was picked.
      candidates: every candidate considered, in the order measured.
      memory_budget_bytes: the budget the candidates' memory estimates were held to.
      measure_seconds: the wall time the measurement took (compilations included).
    """

    signature: str
    strategy: Measured
    chunk_size: int | None
    reason: str
    candidates: tuple[Candidate, ...]
    memory_budget_bytes: int
    measure_seconds: float


class _Choices:
    """The choices of `auto`, by call signature (the compile key with strategy left out)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[Any, ...], Choice] = {}
        self.lock = threading.RLock()  # Held while measuring: one measurement at a time.


_CHOICES = _Choices()


def forget_choices() -> None:
    """Forgets every choice of `auto`: the next call of each signature measures again."""
    with _CHOICES.lock:
        _CHOICES.by_key.clear()


_caches.register_clear("map_reduce auto choices", forget_choices)


class MapReduceFunction(TorchFunction):
    """The class of the map_reduce torch functions: clearing one's cache forgets the choices."""

    def clear_cache(self) -> None:
        """Drops the traced programs and forgets the choices of `auto`."""
        super().clear_cache()
        forget_choices()


def map_reduce_choices() -> list[Choice]:
    """What `map_reduce(strategy="auto")` picked so far, one `Choice` per signature.

    Each choice names the strategy (and chunk size) picked, why, and every candidate with its
    memory estimate and median time. `bridge_mr.clear_caches()` forgets them; the next call of
    a signature measures again.

    Returns:
      The choices, oldest first.

    Example:
      >>> few = {name: value[:4] for name, value in batch.items()}  # 4 clients: a new signature
      >>> bridge_mr.map_reduce(jax_loss, params, few).backward()  # strategy="auto": measures
      >>> choice = bridge_mr.map_reduce_choices()[-1]
      >>> choice.candidates[0].strategy, choice.candidates[0].chunk_size  # vmap goes first
      ('vmap', None)
      >>> choice.strategy in ("vmap", "per_client")  # the fastest (only vmap, when that is fast)
      True
    """
    with _CHOICES.lock:
        return list(_CHOICES.by_key.values())


@dataclasses.dataclass(frozen=True)
class Round:
    """How `auto` runs and measures one kind of round (in one process, or across several).

    Across processes every rank measures the same candidates in the same order, and every
    timing and budget is agreed (the slowest rank's time, the smallest budget) before it
    decides anything: the ranks pick alike and run the same programs.
    """

    keeping: TorchFunction  # Runs vmap and keeps its program for later calls.
    measuring: TorchFunction  # Runs the other candidates; cleared once they are timed.
    program: Callable[..., PyTree]  # The JAX round, for XLA's memory estimates.
    agree_seconds: Callable[[float], float]
    agree_budget: Callable[[int], int]
    across_processes: bool = False


def same(value: Any) -> Any:
    """`value` itself: what one process agrees with itself (`Round.agree_seconds`)."""
    return value


def choose(args: tuple[Any, ...], budget: int | None, round_: Round) -> tuple[Measured, int | None]:
    """The (strategy, chunk_size) for a call with `strategy="auto"`: cached, else measured.

    Args:
      args: the round's positional arguments before the strategy (`fn, server, clients,
        weights, reduce, placement, mesh or layout`).
      budget: the `memory_budget_bytes=` argument, or None.
      round_: how to run and measure the round.

    Returns:
      The strategy and chunk size to run the call with.
    """
    if torch.compiler.is_compiling():  # Dynamo would trace the lookup and the measuring.
        return "vmap", None
    # Unflattenable arguments or unhashable statics: the round's call says which, and the fix.
    try:
        leaves, treedef = jax.tree_util.tree_flatten((args, budget))
        key, tensors = _signature.call_key(leaves, treedef, torch.is_grad_enabled())
        choice = _CHOICES.by_key.get(key)
    except (TypeError, ValueError):
        return "vmap", None
    if choice is not None:
        return choice.strategy, choice.chunk_size
    if not _measurable(tensors):
        return "vmap", None
    with _CHOICES.lock:
        choice = _CHOICES.by_key.get(key)
        if choice is None:
            choice = _measure(args, tensors, budget, round_)
            if len(_CHOICES.by_key) >= _MAX_CHOICES:
                del _CHOICES.by_key[next(iter(_CHOICES.by_key))]
            _CHOICES.by_key[key] = choice
    return choice.strategy, choice.chunk_size


def _measurable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether timing calls now means something: torch CPU / CUDA tensors, no transform."""
    if not tensors or any(t.device.type not in ("cpu", "cuda") for t in tensors):
        return False
    return not (torch_compat.functorch_transforms_active() or torch_compat.forward_ad_active())


def _measure(
    args: tuple[Any, ...], tensors: Sequence[torch.Tensor], budget: int | None, round_: Round
) -> Choice:
    started = time.perf_counter()
    fn, server, clients, _, reduce, placement, mesh = args
    if round_.across_processes:
        mesh = None  # The layout: the program's own mesh has an Auto placement axis.
    n = _client_count(clients)
    grads = [t for t in tensors if torch.is_grad_enabled() and t.requires_grad]
    plans: list[tuple[Measured, int | None]] = [("vmap", None)]
    if not _explicit_placement(placement, mesh):  # Which only vmap supports.
        plans += [("per_client", None), *(("chunks", k) for k in AUTO_CHUNK_SIZES if k < n)]
    estimates = {plans[0]: _memory_estimate(round_, args, "vmap", None, bool(grads))}
    if budget is None:
        budget = round_.agree_budget(_default_budget(tensors[0].device))
        if (estimates[plans[0]] or 0) > AUTO_MEMORY_FLOOR:  # Else no candidate is cut.
            estimates.update(
                {p: _memory_estimate(round_, args, *p, bool(grads)) for p in plans[1:]}
            )
            leanest = min((m for m in estimates.values() if m is not None), default=None)
            if leanest is not None:
                cap = max(AUTO_MEMORY_FACTOR * leanest, AUTO_MEMORY_FLOOR)
                budget = min(budget, cap)
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    # Every candidate's first timed call, then more calls for those that can still win: a
    # slow candidate (vmap of a CNN's grouped convolutions) costs two calls, not four.
    entries: list[tuple[Measured, int | None, int | None, str, Callable[[], None] | None]] = []
    times: dict[int, list[float]] = {}
    try:
        for strategy, chunk_size in plans:
            if times.get(0) and times[0][0] < AUTO_MIN_SECONDS:
                entries.append((strategy, chunk_size, None, _TOO_FAST, None))
                continue
            if (strategy, chunk_size) not in estimates:
                estimates[strategy, chunk_size] = _memory_estimate(
                    round_, args, strategy, chunk_size, bool(grads)
                )
            memory = estimates[strategy, chunk_size]
            if memory is not None and memory > budget:
                entries.append((strategy, chunk_size, memory, "over the memory budget", None))
                continue
            # vmap, the usual choice, runs in `round_.keeping`, which keeps its program for later.
            runner = round_.keeping if strategy == "vmap" else round_.measuring

            def call(
                runner: TorchFunction = runner,
                strategy: Measured = strategy,
                chunk_size: int | None = chunk_size,
            ) -> None:
                _backward(runner(*args, strategy, chunk_size), grads)

            call()  # Untimed: traces and compiles.
            times[len(entries)] = [round_.agree_seconds(_timed(call, cuda))]
            entries.append((strategy, chunk_size, memory, "", call))
        best = min((t[0] for t in times.values()), default=0.0)
        for i, timed in times.items():
            again = entries[i][4]
            assert again is not None  # Timed, so callable.
            while len(timed) < AUTO_REPEATS and timed[-1] <= AUTO_GIVE_UP * best:
                timed.append(round_.agree_seconds(_timed(again, cuda)))
    finally:
        round_.measuring.clear_cache()
    candidates = [
        Candidate(strategy, chunk_size, memory, None, skipped)
        if i not in times
        else Candidate(
            strategy, chunk_size, memory, statistics.median(times[i]), timed_calls=len(times[i])
        )
        for i, (strategy, chunk_size, memory, skipped, _) in enumerate(entries)
    ]
    choice = _pick(candidates, budget)
    choice = dataclasses.replace(
        choice,
        signature=_describe(fn, server, clients, reduce, bool(grads)),
        measure_seconds=time.perf_counter() - started,
    )
    _LOG.debug(
        "map_reduce(strategy='auto') for %s: picked %s (%s); candidates: %s; measuring took %.3f s",
        choice.signature,
        _label(choice.strategy, choice.chunk_size),
        choice.reason,
        "; ".join(_candidate_text(c) for c in choice.candidates),
        choice.measure_seconds,
    )
    return choice


def _pick(candidates: list[Candidate], budget: int) -> Choice:
    """The fastest timed candidate; vmap unless another is clearly (AUTO_MARGIN) faster."""
    timed = [c for c in candidates if c.seconds is not None]
    frozen = tuple(candidates)
    if not timed:
        smallest = min(candidates, key=lambda c: c.memory_bytes or 0)
        reason = "every candidate is over the memory budget: the one needing the least memory"
        return Choice("", smallest.strategy, smallest.chunk_size, reason, frozen, budget, 0.0)
    best = min(timed, key=lambda c: c.seconds or 0.0)
    vmap = next((c for c in timed if c.strategy == "vmap"), None)
    if vmap is None:
        reason = "the fastest of those within the memory budget (vmap is over it)"
    elif best is vmap:
        reason = "the fastest"
    elif (best.seconds or 0.0) < AUTO_MARGIN * (vmap.seconds or 0.0):
        reason = f"faster than vmap by more than {1 - AUTO_MARGIN:.0%}"
    else:
        best = vmap
        reason = f"no candidate beats vmap by more than {1 - AUTO_MARGIN:.0%}"
    return Choice("", best.strategy, best.chunk_size, reason, frozen, budget, 0.0)


def _backward(out: PyTree, grads: Sequence[torch.Tensor]) -> None:
    """The backward pass the caller would run, without touching any `.grad`."""
    if not grads:
        return
    outputs = [o for o in jax.tree.leaves(out) if o.requires_grad]
    if outputs:
        torch.autograd.grad(
            outputs, list(grads), [torch.ones_like(o) for o in outputs], allow_unused=True
        )


def _timed(call: Callable[[], None], cuda: torch.device | None) -> float:
    """Seconds one `call` takes (synchronising `cuda`, if any, before and after)."""
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    start = time.perf_counter()
    call()
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    return time.perf_counter() - start


def _memory_estimate(
    round_: Round, args: tuple[Any, ...], strategy: Measured, chunk_size: int | None, grads: bool
) -> int | None:
    """XLA's estimate of the bytes a candidate needs, or None where the backend has none."""
    fn, server, clients, weights, reduce, placement, mesh = args

    def as_spec(path: Any, leaf: Any, arg: str, per_rank: bool) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        # Named as the call names it (a float64 leaf, x64 off: "map_reduce: argument server['w']").
        where = f"map_reduce: argument {arg}{jax.tree_util.keystr(path)}"
        ((shape, dtype),) = tensor_avals([leaf], [where])
        if not isinstance(mesh, distributed.Layout):
            return jax.ShapeDtypeStruct(shape, dtype)
        spec = jax.sharding.PartitionSpec(placement) if per_rank else jax.sharding.PartitionSpec()
        return jax.ShapeDtypeStruct(
            mesh.global_shape(shape) if per_rank else shape,
            dtype,
            sharding=jax.sharding.NamedSharding(mesh.mesh, spec),
        )

    def forward(server: PyTree, clients: PyTree, weights: PyTree) -> PyTree:
        return round_.program(
            fn, server, clients, weights, reduce, placement, mesh, strategy, chunk_size
        )

    def with_grads(server: PyTree, clients: PyTree, weights: PyTree) -> PyTree:
        def total(*inputs: PyTree) -> jax.Array:
            floats = [
                o for o in jax.tree.leaves(forward(*inputs)) if jnp.issubdtype(o.dtype, jnp.inexact)
            ]
            return sum((jnp.sum(o).real.astype(jnp.float32) for o in floats), jnp.float32(0))

        return jax.value_and_grad(total, argnums=(0, 1, 2), allow_int=True)(
            server, clients, weights
        )

    specs = tuple(
        jax.tree_util.tree_map_with_path(
            lambda path, leaf, arg=arg: as_spec(path, leaf, arg, arg != "server"), tree
        )
        for arg, tree in (("server", server), ("clients", clients), ("weights", weights))
    )
    try:
        stats = jax.jit(with_grads if grads else forward).lower(*specs).compile().memory_analysis()
    except Exception:  # Bad arguments: the timed call raises again, with the bridge's message.
        return None
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _default_budget(device: torch.device) -> int:
    """Half the device's memory limit (CUDA), or half the host's physical memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _client_count(clients: PyTree) -> int:
    """The clients' leading dimension (0 when there is none: the vmap call then says why)."""
    try:
        return int(
            jax_core.client_count(clients, array_types=(torch.Tensor, jax.Array, np.ndarray))
        )
    except (TypeError, ValueError):
        return 0


def _explicit_placement(placement: str, mesh: Mesh | AbstractMesh | None) -> bool:
    """Whether the call's mesh has `placement` as an Explicit axis."""
    mesh = jax_core.ambient_mesh() if mesh is None else mesh
    if mesh is None or placement not in mesh.axis_names:
        return False
    return mesh.axis_types[mesh.axis_names.index(placement)] == jax.sharding.AxisType.Explicit


def _describe(fn: Any, server: PyTree, clients: PyTree, reduce: str, grads: bool) -> str:
    def shapes(tree: PyTree) -> str:
        return ", ".join(
            f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for t in jax.tree.leaves(tree)
            if isinstance(t, torch.Tensor)
        )

    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (
        f"map_reduce({name}, server=[{shapes(server)}], clients=[{shapes(clients)}], "
        f"reduce={reduce!r}{', with gradients' if grads else ''})"
    )


def _label(strategy: str, chunk_size: int | None) -> str:
    return f"chunks of {chunk_size}" if strategy == "chunks" else strategy


def _candidate_text(candidate: Candidate) -> str:
    memory = "?" if candidate.memory_bytes is None else f"{candidate.memory_bytes / 2**20:.1f} MiB"
    timing = candidate.skipped if candidate.seconds is None else f"{candidate.seconds * 1e3:.2f} ms"
    return f"{_label(candidate.strategy, candidate.chunk_size)}: {timing}, {memory}"
