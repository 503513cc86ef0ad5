"""`map_reduce(strategy="auto")`: pick a strategy once per signature, at little cost.

For a call signature (the compile key without the strategy), `choose` traces the client
function once (`_round.trace_client`; every program of the call evaluates that trace instead of
running the function again), then reads each candidate's round program from its jaxpr, without
compiling anything (`_cost.cost`): candidates that vmap would turn into grouped convolutions
(per-client weights feeding a convolution, on CPU) or whose memory is over the budget are ruled
out, and the cost model's favourite of the rest is picked: vmap, unless another needs clearly
fewer operations (`AUTO_MARGIN`). Nothing is compiled or run but the call itself, whose program
is kept, whatever was picked. With `AUTO_TIMING` the candidates left are timed instead, within
`AUTO_TIME_BOX`. Each decision is also kept on disk (`_decisions`), so the next process reads
it. The tuning constants below are read at each decision; `map_reduce_choices` lists what was
picked and why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from bridge_mr import _caches
from bridge_mr._compat import torch as torch_compat

from . import _choice, _decisions, _programs, _signature
from ._choice import Candidate as Candidate
from ._choice import Choice, Plan
from ._cost import Cost
from ._function import TorchFunction
from ._round import Measured, PyTree, trace_client

#: The chunk sizes `auto` considers (those below the number of clients).
AUTO_CHUNK_SIZES: tuple[int, ...] = (16, 128)
#: A candidate replaces one `auto` prefers (vmap, then larger chunks, then per_client) only
#: when its operation count (or, timed, its median time) is below this fraction of that one's.
AUTO_MARGIN = 0.9
#: Without `memory_budget_bytes`, a candidate estimated to need over this many times the
#: leanest candidate's memory, and over `AUTO_MEMORY_FLOOR` bytes, is ruled out (vmap of a CNN
#: round at 50 clients: 4x the torch loop's memory).
AUTO_MEMORY_FACTOR = 4
AUTO_MEMORY_FLOOR = 1 << 30
#: Time the candidates the cost model leaves, rather than take its favourite. Each timed
#: candidate is compiled and run (its program kept) a few times, which costs about one first
#: call each: measuring on a first call what the cost model cannot see.
AUTO_TIMING = False
#: When timing: a candidate after the first is tried only while what timing spent beyond the
#: first candidate's first call, plus one more such call, stays under this fraction of it.
AUTO_TIME_BOX = 0.5
#: When timing: calls per candidate after its first (which traces and compiles).
AUTO_REPEATS = 3
#: When timing: a candidate whose first timed call takes over this multiple of the fastest
#: first timed call is not timed again: it cannot win.
AUTO_GIVE_UP = 2.0
#: When timing: a vmap whose timed call takes less (seconds) is kept without trying the others.
AUTO_MIN_SECONDS = 0.005
_MAX_CHOICES = 256

_LOG = logging.getLogger("bridge_mr")
_TOO_FAST = "not tried: vmap takes under AUTO_MIN_SECONDS"


_RULED_OUT_GROUPED = (
    "ruled out: it would vmap the client's convolutions over per-client weights, a grouped "
    "convolution (clients x channels), which XLA:CPU runs several times slower"
)
_OVER_BUDGET = "ruled out: over the memory budget"


class _Choices:
    """The choices of `auto`, by call signature (the compile key with strategy left out)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[Any, ...], Choice] = {}
        self.lock = threading.RLock()  # Held while deciding: one decision at a time.


_CHOICES = _Choices()


def forget_choices() -> None:
    """Forgets every choice of `auto` held in memory: the next call of each signature decides
    again (reading the decision kept on disk, if any: `_decisions`)."""
    with _CHOICES.lock:
        _CHOICES.by_key.clear()


_caches.register_clear("map_reduce auto choices", forget_choices)


class MapReduceFunction(TorchFunction):
    """The class of the map_reduce torch functions: clearing one's cache forgets the choices."""

    def clear_cache(self) -> None:
        """Drops the traced programs and forgets the choices of `auto` held in memory."""
        super().clear_cache()
        forget_choices()


def map_reduce_choices() -> list[Choice]:
    """What `map_reduce(strategy="auto")` picked so far, one `Choice` per signature.

    Each choice names the strategy (and chunk size) picked, why, and every candidate with its
    estimated memory and operations (and median time, when timed). `bridge_mr.clear_caches()`
    forgets them; the next call of a signature decides again, or reads the decision an earlier
    process kept on disk.

    Returns:
      The choices, oldest first.

    Example:
      >>> few = {name: value[:4] for name, value in batch.items()}  # 4 clients: a new signature
      >>> bridge_mr.map_reduce(jax_loss, params, few).backward()  # strategy="auto": decides
      >>> choice = bridge_mr.map_reduce_choices()[-1]
      >>> [(c.strategy, c.chunk_size) for c in choice.candidates]  # chunks below 4 clients only
      [('vmap', None), ('per_client', None)]
      >>> choice.strategy, choice.reason  # picked by the cost model: nothing else was run
      ('vmap', 'the cost model: no candidate needs 10% fewer operations')
      >>> choice.candidates[1].skipped
      'not timed: the cost model prefers vmap'
    """
    with _CHOICES.lock:
        return list(_CHOICES.by_key.values())


@dataclasses.dataclass(frozen=True)
class Round:
    """How `auto` runs and measures one kind of round (in one process, or across several).

    Across processes every rank decides from the same programs and agrees every timing and
    budget (the slowest rank's time, the smallest budget) before it decides anything: the
    ranks pick alike and run the same programs. The decisions on disk are not used there (the
    ranks' disks may disagree).
    """

    keeping: TorchFunction  # Runs the round (a timed candidate too): its programs are kept.
    program: Callable[..., PyTree]  # The JAX round, for the cost model's jaxprs.
    agree_seconds: Callable[[float], float]
    agree_budget: Callable[[int], int]
    across_processes: bool = False


def same(value: Any) -> Any:
    """`value` itself: what one process agrees with itself (`Round.agree_seconds`)."""
    return value


def choose(args: tuple[Any, ...], budget: int | None, round_: Round) -> tuple[Measured, int | None]:
    """The (strategy, chunk_size) for a call with `strategy="auto"`: kept, else decided.

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
            choice = _decide(args, tensors, budget, round_)
            if choice is None:  # The arguments are bad: the call says how.
                return "vmap", None
            if len(_CHOICES.by_key) >= _MAX_CHOICES:
                del _CHOICES.by_key[next(iter(_CHOICES.by_key))]
            _CHOICES.by_key[key] = choice
    return choice.strategy, choice.chunk_size


def _measurable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether timing calls now means something: torch CPU / CUDA tensors, no transform."""
    if not tensors or any(t.device.type not in ("cpu", "cuda") for t in tensors):
        return False
    return not (torch_compat.functorch_transforms_active() or torch_compat.forward_ad_active())


def _decide(
    args: tuple[Any, ...], tensors: Sequence[torch.Tensor], budget: int | None, round_: Round
) -> Choice | None:
    """The choice for a new signature: read from disk, else decided; None for bad arguments."""
    started = time.perf_counter()
    fn, server, clients, _, reduce, placement, mesh = args
    grads = [t for t in tensors if torch.is_grad_enabled() and t.requires_grad]
    signature = _choice.describe(fn, server, clients, reduce, bool(grads))
    n = _programs.client_count(clients)
    try:
        specs = _programs.specs(args, round_.across_processes)
        # Across processes the round's placement is the global client count (the specs').
        rows = jax.tree.leaves(specs[1])[0].shape[0] if round_.across_processes else n
        client = trace_client(fn, *_programs.one_client(specs), placement, rows)
    except Exception:  # The call raises again, with the bridge's message.
        return None
    disk = None
    if not round_.across_processes:
        disk = _decisions.name(
            _programs.fingerprint(client.jaxpr, args, specs, tensors, budget, _constants())
        )
        record = _decisions.load(disk)
        choice = _choice.from_record(record, signature) if record is not None else None
        if choice is not None:
            seconds = time.perf_counter() - started
            _LOG.debug("map_reduce(strategy='auto') for %s: %s, kept on disk", signature, choice)
            return dataclasses.replace(choice, measure_seconds=seconds)
    if round_.across_processes:
        mesh = None  # The layout: the program's own mesh has an Auto placement axis.
    plans: list[Plan] = [("vmap", None)]
    if not _programs.explicit_placement(placement, mesh):  # Which only vmap supports.
        plans += [("per_client", None), *(("chunks", k) for k in AUTO_CHUNK_SIZES if k < n)]
    costs = {p: _programs.round_cost(round_.program, args, specs, p, bool(grads)) for p in plans}
    budget = _budget(budget, costs, tensors[0].device, round_)
    skipped = _ruled_out(costs, budget, tensors[0].device.type == "cpu")
    ranked = _ranked([p for p in plans if p not in skipped], costs)
    times: dict[Plan, list[float]] = {}
    if AUTO_TIMING and len(ranked) > 1:
        times, not_timed = _time(args, ranked, grads, round_, tensors)
        skipped.update(not_timed)
        choice = _pick_timed(plans, costs, times, skipped, budget)
    else:
        choice = _pick_modelled(plans, costs, ranked, skipped, budget)
    choice = dataclasses.replace(
        choice, signature=signature, measure_seconds=time.perf_counter() - started
    )
    if disk is not None:
        _decisions.store(disk, _choice.record(choice))
    _LOG.debug(
        "map_reduce(strategy='auto') for %s: picked %s (%s); candidates: %s; deciding took %.3f s",
        choice.signature,
        _choice.label(choice.strategy, choice.chunk_size),
        choice.reason,
        "; ".join(_choice.candidate_text(c) for c in choice.candidates),
        choice.measure_seconds,
    )
    return choice


def _budget(
    budget: int | None, costs: dict[Plan, Cost | None], device: torch.device, round_: Round
) -> int:
    """The memory budget: the caller's, else half the device's, at most `AUTO_MEMORY_FACTOR`
    times the leanest candidate's estimate when vmap's is over `AUTO_MEMORY_FLOOR`."""
    if budget is not None:
        return budget
    budget = round_.agree_budget(_programs.default_budget(device))
    known = [c.peak_bytes for c in costs.values() if c is not None]
    vmap = costs[("vmap", None)]
    if vmap is not None and vmap.peak_bytes > AUTO_MEMORY_FLOOR and known:
        budget = min(budget, max(AUTO_MEMORY_FACTOR * min(known), AUTO_MEMORY_FLOOR))
    return budget


def _ruled_out(costs: dict[Plan, Cost | None], budget: int, cpu: bool) -> dict[Plan, str]:
    """The candidates the cost model rules out, and why (a candidate it cannot read stays)."""
    reference = costs.get(("per_client", None))
    out: dict[Plan, str] = {}
    for plan, found in costs.items():
        if found is None:
            continue
        batched = plan[0] != "per_client"
        if cpu and batched and reference is not None and found.conv_groups > reference.conv_groups:
            out[plan] = _RULED_OUT_GROUPED
        elif found.peak_bytes > budget:
            out[plan] = _OVER_BUDGET
    return out


def _ranked(plans: list[Plan], costs: dict[Plan, Cost | None]) -> list[Plan]:
    """`plans` in `auto`'s preference (vmap, larger chunks, per_client), the cost model's
    favourite first: the first that needs fewer than `AUTO_MARGIN` times the operations of
    every one preferred to it."""
    order = sorted(plans, key=lambda p: (p[0] == "per_client", -(p[1] or math.inf)))
    if not order:
        return order
    best = order[0]
    for plan in order[1:]:
        mine, theirs = costs[plan], costs[best]
        if mine is not None and theirs is not None and mine.flops < AUTO_MARGIN * theirs.flops:
            best = plan
    return [best, *(p for p in order if p != best)]


def _pick_modelled(
    plans: list[Plan],
    costs: dict[Plan, Cost | None],
    ranked: list[Plan],
    skipped: dict[Plan, str],
    budget: int,
) -> Choice:
    """The cost model's favourite, untimed (or the leanest, when all are over the budget)."""
    if not ranked:
        return _leanest(plans, costs, skipped, budget)
    best = ranked[0]
    for plan in ranked[1:]:
        skipped[plan] = f"not timed: the cost model prefers {_choice.label(*best)}"
    if len(ranked) == 1:
        reason = "the only candidate the cost model did not rule out"
    elif best[0] == "vmap":
        reason = f"the cost model: no candidate needs {1 - AUTO_MARGIN:.0%} fewer operations"
    else:
        reason = (
            f"the cost model: it needs {1 - AUTO_MARGIN:.0%} fewer operations than those "
            "preferred to it"
        )
    candidates = _choice.candidates(plans, costs, skipped, {})
    return Choice("", best[0], best[1], reason, candidates, budget, 0.0)


def _leanest(
    plans: list[Plan], costs: dict[Plan, Cost | None], skipped: dict[Plan, str], budget: int
) -> Choice:
    """Every candidate ruled out: the one needing the least memory."""
    best = min(plans, key=lambda p: math.inf if costs[p] is None else costs[p].peak_bytes)  # type: ignore[union-attr]
    reason = "every candidate is over the memory budget: the one needing the least memory"
    if any(s == _RULED_OUT_GROUPED for s in skipped.values()):
        reason = "every candidate is ruled out: the one needing the least memory"
    candidates = _choice.candidates(plans, costs, skipped, {})
    return Choice("", best[0], best[1], reason, candidates, budget, 0.0)


def _pick_timed(
    plans: list[Plan],
    costs: dict[Plan, Cost | None],
    times: dict[Plan, list[float]],
    skipped: dict[Plan, str],
    budget: int,
) -> Choice:
    """The fastest timed candidate; vmap unless another is clearly (AUTO_MARGIN) faster."""
    candidates = _choice.candidates(plans, costs, skipped, times)
    timed = [c for c in candidates if c.seconds is not None]
    best = min(timed, key=lambda c: c.seconds or 0.0)
    vmap = next((c for c in timed if c.strategy == "vmap"), None)
    if vmap is None:
        reason = "the fastest of those timed (vmap was ruled out)"
    elif best is vmap:
        reason = "the fastest"
    elif (best.seconds or 0.0) < AUTO_MARGIN * (vmap.seconds or 0.0):
        reason = f"faster than vmap by more than {1 - AUTO_MARGIN:.0%}"
    else:
        best = vmap
        reason = f"no candidate beats vmap by more than {1 - AUTO_MARGIN:.0%}"
    return Choice("", best.strategy, best.chunk_size, reason, candidates, budget, 0.0)


def _time(
    args: tuple[Any, ...],
    ranked: list[Plan],
    grads: Sequence[torch.Tensor],
    round_: Round,
    tensors: Sequence[torch.Tensor],
) -> tuple[dict[Plan, list[float]], dict[Plan, str]]:
    """Times `ranked` in order (`AUTO_TIMING`): each one's first call (which compiles, and whose
    program `round_.keeping` keeps), one timed call, then more calls for those that can still
    win; within `AUTO_TIME_BOX`. Returns the times and why the others were not timed."""
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    times: dict[Plan, list[float]] = {}
    calls: dict[Plan, Callable[[], None]] = {}
    skipped: dict[Plan, str] = {}
    first = spent = 0.0
    for plan in ranked:
        if plan != ranked[0] and ranked[0][0] == "vmap" and times[ranked[0]][0] < AUTO_MIN_SECONDS:
            skipped[plan] = _TOO_FAST
            continue
        if plan != ranked[0] and spent > AUTO_TIME_BOX * first:
            skipped[plan] = "not timed: over AUTO_TIME_BOX (the cost model's favourite is kept)"
            continue

        def call(plan: Plan = plan) -> None:
            _programs.backward(round_.keeping(*args, *plan), grads)

        seconds = round_.agree_seconds(_programs.timed(call, cuda))  # Traces and compiles.
        first = first or seconds
        times[plan] = [round_.agree_seconds(_programs.timed(call, cuda))]
        spent += seconds + times[plan][0]
        calls[plan] = call
    best = min(t[0] for t in times.values())
    for plan, timed in times.items():
        while len(timed) < AUTO_REPEATS and timed[-1] <= AUTO_GIVE_UP * best:
            timed.append(round_.agree_seconds(_programs.timed(calls[plan], cuda)))
    return times, skipped


def _constants() -> list[Any]:
    """auto's tuning constants, as read now (a decision depends on them)."""
    return [
        AUTO_CHUNK_SIZES, AUTO_MARGIN, AUTO_MEMORY_FACTOR, AUTO_MEMORY_FLOOR, AUTO_TIMING,
        AUTO_TIME_BOX, AUTO_REPEATS, AUTO_GIVE_UP, AUTO_MIN_SECONDS,
    ]  # fmt: skip
