"""`map_reduce`: broadcast → per-client map → reduce as one compiled, differentiable call.

The round itself is `bridge_mr.jax_core.map_reduce`; this module makes it a `TorchFunction` and
adds `strategy="auto"`, which measures the strategies once per signature and keeps the fastest
(`map_reduce_choices` lists what it picked and why).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeAlias, cast

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import distributed, jax_core
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import jax_dtype

from . import _signature, _weights
from ._function import TorchFunction

PyTree: TypeAlias = Any
Reduction: TypeAlias = Literal["mean", "sum", "weighted_mean"]
Strategy: TypeAlias = Literal["auto", "vmap", "per_client", "chunks"]
Measured: TypeAlias = Literal["vmap", "per_client", "chunks"]
_STRATEGIES: tuple[str, ...] = ("auto", "vmap", "per_client", "chunks")
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


class ClientFn(Protocol):
    """A JAX function of (server value, one client's slice) returning a pytree of arrays."""

    def __call__(self, server: PyTree, client: PyTree, /) -> PyTree: ...


def map_reduce(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    *,
    reduce: Reduction = "mean",
    weights: PyTree | None = None,
    placement: str = "clients",
    mesh: Mesh | AbstractMesh | None = None,
    check_weights: bool = True,
    strategy: Strategy = "auto",
    chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
) -> PyTree:
    """Broadcasts `server` to every client, maps `fn(server, client)` over clients, reduces.

    With torch tensors the whole round is one compiled program and one autograd node:
    gradients reach both `server` and `clients` (e.g. `dict(model.named_parameters())` as
    `server`). With JAX arrays only, it is the JAX program itself
    (`bridge_mr.jax_core.map_reduce`).

    Strategies (same values and gradients, different speed and memory): "vmap" runs all
    clients at once; "per_client" runs one client at a time in an XLA loop (the memory of one
    client, no grouped convolutions); "chunks" runs `chunk_size` clients at a time (memory
    O(chunk_size), forward and gradient alike). "auto" (the default) measures, once per
    signature, vmap, per_client and chunks of 16 and 128 (those below the client count) on the
    call's own tensors: each candidate is compiled once to read its memory estimate (XLA's
    memory analysis), those over `memory_budget_bytes` are never run, the others run once
    untimed and then `AUTO_REPEATS` times timed (with the backward pass when gradients are
    needed, through `torch.autograd.grad`, so no `.grad` changes): one timed call each first,
    then the rest for those within `AUTO_GIVE_UP` times the fastest (the others cannot win).
    vmap goes first; when it takes under `AUTO_MIN_SECONDS` the others are not tried (too
    little to gain). The fastest median wins, but a candidate replaces vmap only when it is
    clearly faster (median below `AUTO_MARGIN` times vmap's), so noise never picks a slower
    strategy. That cost, two compilations and up to four calls per candidate tried (vmap's
    program is kept for later calls, and counts in `trace_counts`), is paid on the first call
    of a signature; later calls run the choice directly.
    `bridge_mr.map_reduce_choices()` lists the choices with their timings, and the
    "bridge_mr" logger reports each at DEBUG level. "auto" runs vmap without measuring for
    JAX inputs, torch-xla tensors (whose lazy calls cannot be timed one by one) and under
    `torch.compile`; under `torch.func` transforms and forward-mode AD it uses a choice already
    made for the signature, else vmap.

    Tracing: each distinct signature (tree structure, shapes, dtypes, devices, which tensors
    need gradients, JAX's configuration, the ambient mesh) is traced and compiled once. `fn` is
    part of that signature. A function re-created on every call (a lambda, a
    `functools.partial`, a bound method such as `trainer.loss`) reuses the trace of an earlier
    one when bridge_mr can compare everything it reads by value -- its code, the globals it
    reads, its defaults and captured values, a bound method's `self` -- that is, when these are
    numbers, strings, tuples of those, frozen dataclasses, immutable JAX / numpy arrays,
    modules, classes or other such functions. Otherwise (it reads a dict, a list, a mutable
    object such as a trainer, a torch tensor), it is traced again, as `jax.jit` would trace a
    new function object, and a `bridge_mr.RetraceWarning` says so after a few such traces. The
    JAX gotcha holds for the *same* function object: state it reads while tracing (an
    attribute, a dict entry) and then changes is not seen by later calls, with `jax.jit` as
    here. Pass values that change between calls, such as a learning rate, as tensors (in
    `server` or `clients`). `bridge_mr.trace_counts()` tells how often this has traced.

    Args:
      fn: a JAX function `fn(server, client)` of the server value and one client's slice of
        `clients`, returning a JAX array or a pytree of them.
      server: a pytree of torch tensors (or numbers), broadcast to every client.
      clients: a pytree of torch tensors whose leading dimension (the same for every leaf) is
        the clients axis.
      reduce: "mean", "sum" or "weighted_mean" (sum(x·w) / sum(w)).
      weights: for "weighted_mean": one weight per client (shape [n]), or a pytree shaped like
        `fn`'s output with the clients axis first.
      placement: the name of the clients axis, as in `program(placements=...)` and meshes.
      mesh: a mesh (or `jax.set_mesh`) whose `placement` axis the clients are sharded over.
      check_weights: check that the weights are finite and do not sum to zero (CPU tensors
        before the program; CUDA tensors by device reductions read after it, when the bridge
        waits for its results anyway; torch-xla tensors by one small device read before it).
        False gives raw IEEE results (NaN / inf) and skips that work.
      strategy: "auto", "vmap", "per_client" or "chunks" (see above).
      chunk_size: for "chunks": how many clients run at once (a positive int).
      memory_budget_bytes: for "auto": the most memory a candidate may need by XLA's estimate
        (default: half the device's memory limit, or half the host's memory on CPU, and at
        most `AUTO_MEMORY_FACTOR` times the leanest candidate's estimate when that is over
        `AUTO_MEMORY_FLOOR`).

    Returns:
      The reduction of `fn`'s results, with `fn`'s output structure: torch tensors for torch
      inputs, JAX arrays for JAX inputs.

    Raises:
      ValueError: bad `reduce`, `weights`, `strategy`, `chunk_size` or `memory_budget_bytes`,
        zero clients, clients that disagree on their count, or weights that are not finite or
        sum to zero.
      TypeError: `fn` not callable or returning non-arrays, leaves that are not tensors,
        tensors JAX cannot take (sparse, meta, unsupported dtypes), mixed torch and JAX inputs.

    Example:
      >>> params = dict(model.named_parameters())
      >>> loss = bridge_mr.map_reduce(client_loss, params, {"x": xs, "y": ys})  # xs: [n, ...]
      >>> loss.backward()  # gradients in model's .grad
      >>> delta = bridge_mr.map_reduce(local_sgd, params, data, strategy="chunks", chunk_size=32)
    """
    _check_strategy(strategy, chunk_size, memory_budget_bytes)
    if distributed.multi_process() and _holds_tensors((server, clients, weights)):
        across: Callable[..., PyTree] = _across_processes
        if torch.compiler.is_compiling():
            # It exchanges facts with the other ranks before the program: eagerly, between two
            # graphs (built here: building it imports torch._dynamo).
            across = cast(Callable[..., PyTree], torch.compiler.disable(_across_processes))
        return across(
            fn,
            server,
            clients,
            reduce,
            weights,
            placement,
            mesh,
            check_weights,
            strategy,
            chunk_size,
            memory_budget_bytes,
        )
    check_after = None
    if weights is not None and check_weights and reduce == "weighted_mean":
        check_after = _weights.check_weights(weights)
    args = (fn, server, clients, weights, reduce, placement, mesh)
    if strategy == "auto":
        result = MAP_REDUCE(*args, *_auto(args, memory_budget_bytes))
    else:
        result = MAP_REDUCE(*args, strategy, chunk_size)
    if check_after is not None:
        check_after()
    return result


def _check_strategy(strategy: Any, chunk_size: Any, memory_budget_bytes: Any) -> None:
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise ValueError(
            f"map_reduce(strategy=...): expected one of {', '.join(map(repr, _STRATEGIES))}; "
            f"got {strategy!r}."
        )
    if strategy == "auto" and chunk_size is not None:
        raise ValueError(
            f"map_reduce(chunk_size={chunk_size!r}) is only for strategy='chunks'; "
            "strategy='auto' picks its own. Pass strategy='chunks' with it, or drop chunk_size."
        )
    if memory_budget_bytes is None:
        return
    if strategy != "auto":
        raise ValueError(
            f"map_reduce(memory_budget_bytes=...) is only for strategy='auto' (got "
            f"strategy={strategy!r}, which runs whatever it needs). Drop it, or pass "
            "strategy='auto'."
        )
    if (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes <= 0
    ):
        raise ValueError(
            "map_reduce(memory_budget_bytes=...): expected a positive int (bytes, e.g. "
            f"2 * 2**30); got {type(memory_budget_bytes).__name__}: {memory_budget_bytes!r}."
        )


def map_reduce_jax(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
    strategy: Measured = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """The JAX program behind `map_reduce` (arguments as there, all positional)."""
    return jax_core.map_reduce(
        fn,
        server,
        clients,
        reduce=reduce,
        weights=weights,
        placement=placement,
        mesh=mesh,
        strategy=strategy,
        chunk_size=chunk_size,
    )


class _MapReduceFunction(TorchFunction):
    """`MAP_REDUCE`'s class: clearing its cache forgets the `auto` choices too."""

    def clear_cache(self) -> None:
        super().clear_cache()
        with _CHOICES.lock:
            _CHOICES.by_key.clear()


_ARG_NAMES = (
    "fn",
    "server",
    "clients",
    "weights",
    "reduce",
    "placement",
    "mesh",
    "strategy",
    "chunk_size",
)
MAP_REDUCE = _MapReduceFunction(
    map_reduce_jax, passthrough_jax=True, name="map_reduce", arg_names=_ARG_NAMES
)
# The candidates of `auto` other than vmap run here, so MAP_REDUCE traces only vmap and what
# runs (`trace_counts` stays meaningful) and their programs are dropped once timed. Errors name
# "map_reduce".
_MEASURING = TorchFunction(map_reduce_jax, name="map_reduce", arg_names=_ARG_NAMES)


# --- across processes ----------------------------------------------------------------------


def map_reduce_processes_jax(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    layout: distributed.Layout,
    strategy: Measured = "vmap",
    chunk_size: int | None = None,
) -> PyTree:
    """The round over every rank's clients, on global arrays laid out by `layout`.

    Padding rows (after a rank's own clients) are copies of its last client, so `fn` stays
    finite there; their results are masked to zero (and their weights are zero). Server leaves
    of one float dtype travel as one vector, and so do such results (unless the weights have a
    shape per result): the program then all-reduces one array, not one per leaf (each
    cross-process collective costs milliseconds).
    """
    server_leaves = jax.tree.leaves(server)
    if len(server_leaves) > 1 and _one_float_dtype(server_leaves):
        flat, unravel = jax.flatten_util.ravel_pytree(server)

        def on_flat(flat: jax.Array, client: PyTree, fn: ClientFn = fn) -> PyTree:
            return fn(unravel(flat), client)

        fn, server = on_flat, flat
    one_client = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), clients)
    shapes = jax.eval_shape(fn, server, one_client)
    results = jax.tree.leaves(shapes)
    unravel_results = None
    per_client_weights = weights is None or (
        len(jax.tree.leaves(weights)) == 1 and jax.tree.leaves(weights)[0].ndim == 1
    )
    if len(results) > 1 and per_client_weights and _one_float_dtype(results):
        zeros = jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), shapes)
        unravel_results = jax.flatten_util.ravel_pytree(zeros)[1]

        def packed(server: PyTree, client: PyTree, fn: ClientFn = fn) -> jax.Array:
            return jax.flatten_util.ravel_pytree(fn(server, client))[0]

        fn = packed
    out = _masked_round(
        fn, server, clients, weights, reduce, placement, layout, strategy, chunk_size
    )
    return out if unravel_results is None else unravel_results(out)


def _one_float_dtype(leaves: Sequence[Any]) -> bool:
    dtypes = {np.dtype(leaf.dtype) for leaf in leaves}
    return len(dtypes) == 1 and jnp.issubdtype(next(iter(dtypes)), jnp.inexact)


def _masked_round(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: Reduction,
    placement: str,
    layout: distributed.Layout,
    strategy: Measured,
    chunk_size: int | None,
) -> PyTree:
    """The round with padding rows masked out (see `map_reduce_processes_jax`)."""

    def run(fn: ClientFn, clients: PyTree, reduce: Reduction) -> PyTree:
        return jax_core.map_reduce(
            fn,
            server,
            clients,
            reduce=reduce,
            weights=weights,
            placement=placement,
            mesh=layout.mesh,
            strategy=strategy,
            chunk_size=chunk_size,
        )

    if not layout.padded:
        return run(fn, clients, reduce)

    def masked(server: PyTree, client: tuple[jax.Array, PyTree]) -> PyTree:
        real, data = client
        return jax.tree.map(lambda o: jnp.where(real, o, jnp.zeros_like(o)), fn(server, data))

    inner: Reduction = "sum" if reduce == "mean" else reduce
    real = jnp.asarray(layout.mask())
    out = run(masked, (real, clients), inner)
    if reduce != "mean":
        return out
    default_float = jnp.result_type(float)
    return jax.tree.map(
        lambda total: (
            total / layout.total
            if jnp.issubdtype(total.dtype, jnp.inexact)
            else total.astype(default_float) / layout.total
        ),
        out,
    )


_PROCESS_ARG_NAMES = (*_ARG_NAMES[:6], "layout", *_ARG_NAMES[7:])
MAP_REDUCE_PROCESSES = _MapReduceFunction(
    map_reduce_processes_jax, name="map_reduce", arg_names=_PROCESS_ARG_NAMES
)
_MEASURING_PROCESSES = TorchFunction(
    map_reduce_processes_jax, name="map_reduce", arg_names=_PROCESS_ARG_NAMES
)


def _holds_tensors(tree: PyTree) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in jax.tree.leaves(tree))


def _across_processes(
    fn: ClientFn,
    server: PyTree,
    clients: PyTree,
    reduce: Reduction,
    weights: PyTree | None,
    placement: str,
    mesh: Mesh | AbstractMesh | None,
    check_weights: bool,
    strategy: Strategy,
    chunk_size: int | None,
    memory_budget_bytes: int | None,
) -> PyTree:
    """`map_reduce` over the union of every rank's clients (this rank passes its own)."""
    if mesh is not None:
        raise ValueError(
            "map_reduce(mesh=...): across processes, map_reduce shards the clients over every "
            "process's devices itself (one mesh of all of jax.devices()); got a mesh of "
            f"{getattr(mesh, 'size', '?')} devices. Drop mesh=."
        )
    count = _local_count(clients, weights)
    if weights is not None and check_weights and reduce == "weighted_mean":
        check_after = _weights.check_weights(weights)
        if check_after is not None:
            check_after()
    process = distributed.current()
    checking = process is not None and process.check_replicas
    server_leaves = jax.tree_util.tree_flatten_with_path(server)[0]
    server_tensors = [(p, t) for p, t in server_leaves if isinstance(t, torch.Tensor)]
    counts = distributed.agree(
        count,
        _process_signature(fn, server, clients, weights, reduce, placement, strategy, chunk_size),
        [_tensor_hash(t) for _, t in server_tensors] if checking else None,
        [f"server{jax.tree_util.keystr(p)}" for p, _ in server_tensors],
        where="map_reduce",
    )
    layout = distributed.Layout(
        counts, distributed.slot_for(counts), jax.process_index(), placement
    )
    clients = _pad_rows(clients, count, layout.slot, repeat_last=True)
    if weights is not None:
        weights = _pad_rows(weights, count, layout.slot, repeat_last=False)
    args = (fn, server, clients, weights, reduce, placement, layout)
    if strategy == "auto":
        return MAP_REDUCE_PROCESSES(*args, *_auto(args, memory_budget_bytes, _PROCESSES))
    return MAP_REDUCE_PROCESSES(*args, strategy, chunk_size)


def _local_count(clients: PyTree, weights: PyTree | None) -> int:
    """This rank's client count: the leading dimension every client tensor shares."""
    leaves = jax.tree_util.tree_flatten_with_path(clients)[0]
    if not leaves:
        raise ValueError("map_reduce(clients=...): expected at least one client tensor; got none.")
    dims: dict[str, int | None] = {}
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"map_reduce: across processes, clients{jax.tree_util.keystr(path)} must be a "
                f"torch tensor (this rank's clients along its first axis); got "
                f"{type(leaf).__name__}. Pass torch tensors, or global JAX arrays (then pass "
                "JAX arrays only)."
            )
        dims[f"clients{jax.tree_util.keystr(path)}"] = int(leaf.shape[0]) if leaf.ndim else None
    if len(set(dims.values())) > 1 or None in dims.values():
        shown = ", ".join(f"{k}: {v if v is not None else '0-d'}" for k, v in dims.items())
        raise ValueError(
            f"map_reduce: the client tensors of this rank disagree on their client count (the "
            f"leading dimension): {shown}. Every client tensor needs the same leading dimension."
        )
    count = next(iter(dims.values()))
    assert count is not None
    return count


def _pad_rows(tree: PyTree, count: int, slot: int, *, repeat_last: bool) -> PyTree:
    """Each tensor with rows up to `slot`: copies of its last row (clients) or zeros (weights).

    Differentiable torch ops, so the gradients of the padded tensors reach the given ones.
    """
    if slot == count:
        return tree

    def pad(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
            return leaf
        extra = (slot - count, *leaf.shape[1:])
        rows = leaf[-1:].expand(extra) if repeat_last else leaf.new_zeros(extra)
        return torch.cat([leaf, rows])

    return jax.tree.map(pad, tree)


def _process_signature(
    fn: Any,
    server: PyTree,
    clients: PyTree,
    weights: PyTree | None,
    reduce: str,
    placement: str,
    strategy: str,
    chunk_size: int | None,
) -> str:
    """The call in words, the same on every rank that runs the same program."""

    def avals(tree: PyTree, *, rows: bool) -> str:
        parts = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                shape = list(leaf.shape[1:] if rows else leaf.shape)
                grad = "*" if leaf.requires_grad and torch.is_grad_enabled() else ""
                dtype = str(leaf.dtype).removeprefix("torch.")
                parts.append(f"{jax.tree_util.keystr(path)}:{dtype}{shape}{grad}")
            else:
                parts.append(f"{jax.tree_util.keystr(path)}={leaf!r}")
        return "{" + ", ".join(parts) + "}"

    code = getattr(fn, "__code__", None)
    where = f" at {os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else ""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (
        f"{name}{where} reduce={reduce} strategy={strategy} chunk_size={chunk_size} "
        f"placement={placement} server={avals(server, rows=False)} "
        f"clients={avals(clients, rows=True)} weights={avals(weights, rows=True)}"
    )


def _tensor_hash(tensor: torch.Tensor) -> bytes:
    """A hash of the tensor's bytes (for the replica check)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).digest()


# --- strategy="auto" ------------------------------------------------------------------------


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


def map_reduce_choices() -> list[Choice]:
    """What `map_reduce(strategy="auto")` picked so far, one `Choice` per signature.

    Each choice names the strategy (and chunk size) picked, why, and every candidate with its
    memory estimate and median time. `bridge_mr.clear_caches()` forgets them; the next call of
    a signature measures again.

    Returns:
      The choices, oldest first.

    Example:
      >>> bridge_mr.map_reduce(client_loss, params, batch).backward()
      >>> [(c.strategy, c.chunk_size) for c in bridge_mr.map_reduce_choices()]
      [('vmap', None)]
    """
    with _CHOICES.lock:
        return list(_CHOICES.by_key.values())


@dataclasses.dataclass(frozen=True)
class _Round:
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


def _same(value: Any) -> Any:
    return value


_ONE_PROCESS = _Round(MAP_REDUCE, _MEASURING, map_reduce_jax, _same, _same)
_PROCESSES = _Round(
    MAP_REDUCE_PROCESSES,
    _MEASURING_PROCESSES,
    map_reduce_processes_jax,
    distributed.agree_seconds,
    distributed.agree_minimum,
    across_processes=True,
)


def _auto(
    args: tuple[Any, ...], budget: int | None, round_: _Round | None = None
) -> tuple[Measured, int | None]:
    """The (strategy, chunk_size) for a call with `strategy="auto"`: cached, else measured."""
    round_ = _ONE_PROCESS if round_ is None else round_
    if torch.compiler.is_compiling():  # Dynamo would trace the lookup and the measuring.
        return "vmap", None
    # Unflattenable arguments or unhashable statics: MAP_REDUCE's call says which, and the fix.
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
    args: tuple[Any, ...], tensors: Sequence[torch.Tensor], budget: int | None, round_: _Round
) -> Choice:
    started = time.perf_counter()
    fn, server, clients, _, reduce, placement, mesh = args
    if round_.across_processes:
        mesh = None  # The layout: the program's own mesh has an Auto placement axis.
    n = _client_count_of(clients)
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
            # vmap, the usual choice, runs in MAP_REDUCE, which keeps its program for later.
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
    round_: _Round, args: tuple[Any, ...], strategy: Measured, chunk_size: int | None, grads: bool
) -> int | None:
    """XLA's estimate of the bytes a candidate needs, or None where the backend has none."""
    fn, server, clients, weights, reduce, placement, mesh = args

    def as_spec(leaf: Any, per_rank: bool) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        shape, dtype = tuple(leaf.shape), jax_dtype(leaf.dtype, where="map_reduce")
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

    specs = (
        jax.tree.map(lambda leaf: as_spec(leaf, False), server),
        *(jax.tree.map(lambda leaf: as_spec(leaf, True), tree) for tree in (clients, weights)),
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


def _client_count_of(clients: PyTree) -> int:
    """The clients' leading dimension (0 when there is none: the vmap call then says why)."""
    leaves = jax.tree.leaves(clients)
    shape = getattr(leaves[0], "shape", ()) if leaves else ()
    return int(shape[0]) if shape else 0


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
