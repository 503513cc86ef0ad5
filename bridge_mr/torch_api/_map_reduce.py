"""`map_reduce`: broadcast → per-client map → reduce as one compiled, differentiable call.

The round itself is `bridge_mr.jax_core.map_reduce` (`_round`); this module checks the arguments
and makes it a `TorchFunction`. A call is its key (`_keys.cached_key`), then a hit (the entry an
earlier call of the key ran) or the full path: the checks, the strategy (`strategy="auto"`:
`bridge_mr.auto`, once per signature), the torch function's own key and entry. A round across
processes is `_processes`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import torch
from jax.sharding import AbstractMesh, Mesh

from bridge_mr import auto, distributed, jax_core
from bridge_mr._compat import torch as torch_compat
from bridge_mr.typing import AutoOrStrategy, ClientFn, PyTree, Reduction

from . import _keys, _weights
from ._autograd import Entry, run
from ._function import TorchFunction
from ._ops import OPERATIONS
from ._processes import across_processes, holds_tensors
from ._round import ARG_NAMES, STRATEGIES, auto_option, map_reduce_jax, trace_client


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
    strategy: AutoOrStrategy = "auto",
    chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
) -> PyTree:
    """Broadcasts `server` to every client, maps `fn(server, client)` over clients, reduces.

    With torch tensors the whole round is one compiled program and one autograd node:
    gradients reach both `server` and `clients` (e.g. `dict(model.named_parameters())` as
    `server`). With JAX arrays only, it is the JAX program itself
    (`bridge_mr.jax_core.map_reduce`).

    Strategies (same values and gradients, different speed and memory): "vmap" runs all clients
    at once; "per_client" runs one client at a time in an XLA loop (the memory of one client, no
    grouped convolutions); "chunks" runs `chunk_size` clients at a time (memory O(chunk_size),
    forward and gradient alike), and is what `chunk_size` alone (with `strategy` left at its
    default) means; "packed" runs `chunk_size` clients at a time packed into their channels,
    each convolution over per-client kernels one dense convolution of the block-diagonal kernel
    (`bridge_mr.jax_core.vmap_packed`: for small CNNs on a TPU; a NaN in one client's
    activations, or an infinity in its weights of a linear layer after a flatten, spreads to its
    chunk). "auto" (the default) decides once per signature, among
    vmap, per_client and chunks of 16 and 128 (those below the client count; on a TPU also
    packed chunks of `AUTO_TPU_PACKED`, which it prefers where vmap would group the client's
    convolutions over per-client weights), without compiling or running any but the call itself:
    it traces `fn` once (every candidate and the call evaluate that trace), reads each
    candidate's program from its jaxpr (operations of matrix products and convolutions, peak
    live memory, convolution groups), rules out on CPU the batched strategies that would turn
    convolutions over per-client weights into grouped convolutions, and those over
    `memory_budget_bytes`, and keeps vmap unless another needs clearly fewer operations
    (`AUTO_MARGIN`; the settings: `bridge_mr.auto.settings`). The call then compiles and runs
    the strategy picked, and keeps its program, so the first call of "auto" costs about what the
    first call of the strategy it picks does. Each decision is also kept on disk
    (`$BRIDGE_MR_CACHE_DIR`, else `$XDG_CACHE_HOME/bridge_mr`, else `~/.cache/bridge_mr`;
    `BRIDGE_MR_AUTO_DISK=0` turns it off) so the next process reads it instead of deciding
    again. `bridge_mr.map_reduce_choices()` lists the choices with their estimates, and the
    "bridge_mr" logger reports each at DEBUG level. "auto" runs vmap without deciding for JAX
    inputs, torch-xla tensors (whose lazy calls cannot be timed one by one) and under
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
      mesh: a `jax.sharding.Mesh` (or `AbstractMesh`; default: the mesh of `jax.set_mesh`)
        whose `placement` axis the clients are sharded over.
      check_weights: check that the weights are finite and do not sum to zero (CPU tensors
        before the program; CUDA tensors by device reductions read after it, when the bridge
        waits for its results anyway; torch-xla and TorchTPU tensors by one small device read
        before it).
        False gives raw IEEE results (NaN / inf) and skips that work.
      strategy: "auto", "vmap", "per_client", "chunks" or "packed" (see above).
      chunk_size: for "chunks" and "packed": how many clients run at once (a positive int).
        Given alone (`strategy` left at "auto"), it means strategy="chunks".
      memory_budget_bytes: for "auto": the most memory a candidate may need by the cost
        model's estimate, read from its jaxpr (default: half the device's memory limit, or half
        the host's memory on CPU, and at most `AUTO_MEMORY_FACTOR` times the leanest
        candidate's estimate when that is over `AUTO_MEMORY_FLOOR`: `bridge_mr.auto.settings`).

    Returns:
      The reduction of `fn`'s results, with `fn`'s output structure: torch tensors for torch
      inputs, JAX arrays for JAX inputs.

    Raises:
      ValueError: bad `reduce`, `weights`, `strategy`, `chunk_size` or `memory_budget_bytes`
        (`chunk_size` with strategy "vmap" or "per_client", or with `memory_budget_bytes`),
        zero clients, clients that disagree on their count, or weights that are not finite or
        sum to zero.
      TypeError: `fn` not callable or returning non-arrays, leaves that are not tensors,
        tensors JAX cannot take (sparse, meta, quantized, float64 with x64 off: the message
        names the leaf), mixed torch and JAX inputs, a `mesh` that is not a mesh.

    Example:
      `strategy="vmap"` (or `chunk_size`) here, as "auto" would first decide among the strategies.

      >>> loss = bridge_mr.map_reduce(jax_loss, params, batch, strategy="vmap")  # batch: [8, ...]
      >>> loss  # the mean over the 8 clients of jax_loss(params, client's batch)
      tensor(1., grad_fn=<...>)
      >>> loss.backward()  # the gradients reach params (e.g. dict(model.named_parameters()))
      >>> params["b"].grad
      tensor(-2.)
      >>> update = bridge_mr.map_reduce(local, params, batches, chunk_size=4)  # 4 at a time
      >>> update["delta"]["w"].shape, update["delta"]["b"].shape
      (torch.Size([3]), torch.Size([]))
    """
    options = (reduce, placement, mesh, check_weights, strategy, chunk_size, memory_budget_bytes)
    compiling = torch.compiler.is_compiling()
    process = distributed.current()  # Not `multi_process()`: one Python call fewer per call.
    multi_process = process is not None and process.world_size > 1
    hit = None
    if not (compiling or multi_process):
        cached = _keys.cached_key(fn, (server, clients, weights), options)
        if cached is not None:
            try:
                hit = _Hit(*cached, MAP_REDUCE._hits.get(cached[0]))
            except TypeError:  # An unhashable static: the full path names it.
                hit = None
    if hit is None or hit.entry is None:  # Not a hit: the arguments are checked.
        strategy = _strategy(strategy, chunk_size, memory_budget_bytes)
        jax_core.check_mesh(mesh, caller="map_reduce", placement=placement)
        if multi_process and holds_tensors((server, clients, weights)):
            return _across_processes(fn, server, clients, weights, *options)
    check_after = None
    if weights is not None and check_weights and reduce == "weighted_mean":
        check_after = _weights.check_weights(weights)
    if hit is not None and hit.entry is not None:
        result = run(hit.entry, hit.tensors, hit.arrays)
    else:
        args = (fn, server, clients, weights, reduce, placement, mesh)
        result = _full_path(args, strategy, chunk_size, memory_budget_bytes, hit, compiling)
    if check_after is not None:
        check_after()
    return result


class _Hit(NamedTuple):
    """A call's cached key, its tensors and JAX array inputs, and the entry an earlier call
    left under the key."""

    key: tuple[Any, ...]
    tensors: list[torch.Tensor]
    arrays: list[jax.Array]
    entry: Entry | None


def _full_path(
    args: tuple[ClientFn, PyTree, PyTree, PyTree, Reduction, str, Mesh | AbstractMesh | None],
    strategy: AutoOrStrategy,
    chunk_size: int | None,
    budget: int | None,
    hit: _Hit | None,
    compiling: bool,
) -> PyTree:
    """The round of a call that is not a hit: the strategy, then the torch function's entry
    (kept under the call's cached key), or under `torch.compile` the torch function itself."""
    if strategy == "auto":
        picked = auto_option(args, budget, _ONE_PROCESS)
    else:
        picked = (strategy, chunk_size)
    if compiling:
        return MAP_REDUCE(*args, *picked)
    found = MAP_REDUCE._lookup((*args, *picked), {})
    if found is None:  # JAX inputs: the JAX round itself.
        return map_reduce_jax(*args, *picked)
    if hit is not None:
        _remember(hit, found[0])
    return run(*found)


def _across_processes(fn: ClientFn, server: PyTree, clients: PyTree, weights: PyTree,
                      reduce: Reduction, placement: str, mesh: Any, check_weights: bool,
                      strategy: AutoOrStrategy, chunk_size: int | None,
                      memory_budget_bytes: int | None) -> PyTree:  # fmt: skip
    """The round across torchrun processes (`_processes`), eagerly under `torch.compile`."""
    across: Callable[..., PyTree] = across_processes
    if torch.compiler.is_compiling():
        # It exchanges facts with the other ranks before the program: eagerly, between two
        # graphs (built here: building it imports torch._dynamo).
        across = cast(Callable[..., PyTree], torch.compiler.disable(across_processes))
    return across(fn, server, clients, reduce, weights, placement, mesh, check_weights,
                  strategy, chunk_size, memory_budget_bytes)  # fmt: skip


def _remember(hit: _Hit, entry: Entry) -> None:
    """Keeps the entry a call ran under its cached key (not under torch.func transforms, where
    auto runs vmap without deciding; not where the full path took other tensors)."""
    if torch_compat.functorch_transforms_active() or torch_compat.forward_ad_active():
        return
    spec = entry.traced.spec
    if (len(hit.tensors), len(hit.arrays)) == (len(spec.in_avals), len(spec.array_positions)):
        MAP_REDUCE._remember(hit.key, entry, by_identity=_keys.by_identity(hit.key))


def _strategy(strategy: Any, chunk_size: Any, memory_budget_bytes: Any) -> AutoOrStrategy:
    """The strategy to run, the arguments checked: `chunk_size` alone means "chunks"."""
    if isinstance(strategy, str) and strategy == "auto" and chunk_size is not None:
        if memory_budget_bytes is not None:
            raise ValueError(
                f"map_reduce(chunk_size={chunk_size!r}) means strategy='chunks', which runs "
                "whatever it needs, but memory_budget_bytes=... is only for strategy='auto' "
                "(which picks its own chunk size). Drop one of them."
            )
        strategy = "chunks"
    jax_core.check_strategy(strategy, chunk_size, STRATEGIES)
    checked = cast(AutoOrStrategy, strategy)  # One of STRATEGIES.
    if memory_budget_bytes is None:
        return checked
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
    return checked


MAP_REDUCE = TorchFunction(
    map_reduce_jax, passthrough_jax=True, name="map_reduce", arg_names=ARG_NAMES
)
# `auto` runs (and, with AUTO_TIMING, times) its candidates in MAP_REDUCE itself, so the
# program of the one picked is the one kept.
_ONE_PROCESS = auto.RoundKind(MAP_REDUCE, map_reduce_jax, trace_client, auto.same, auto.same)


def trace_counts() -> dict[str, int]:
    """How many times each torch-level entry point has traced a JAX program so far.

    A training loop whose counts stop growing after its first steps does not retrace. The
    counts include traces of the programs derived from a call (its backward).

    Returns:
      A dict from entry point name ("map_reduce", "broadcast", "map_fn", "reduce_sum",
      "reduce_mean", "reduce_weighted_mean") to its trace count. For a function made with
      `torch_function`, read its own `trace_count`.

    Example:
      >>> step = lambda: bridge_mr.map_reduce(jax_loss, params, batch, strategy="vmap").backward()
      >>> step()  # traces (forward and backward) on the first call of this signature
      >>> before = bridge_mr.trace_counts()["map_reduce"]
      >>> for _ in range(3):
      ...     step()
      >>> bridge_mr.trace_counts()["map_reduce"] == before  # the same signature: no new trace
      True
      >>> sorted(bridge_mr.trace_counts())
      ['broadcast', 'map_fn', 'map_reduce', 'reduce_mean', 'reduce_sum', 'reduce_weighted_mean']
    """
    functions = (MAP_REDUCE, *OPERATIONS)
    return {repr(fn): fn.trace_count for fn in functions}
