"""`map_reduce(strategy="auto")`: pick a strategy once per signature, at little cost.

For a call signature (the compile key without the strategy, which the caller builds), `choose`
traces the client function once (`RoundKind.trace_client`; every program of the call evaluates
that trace instead of running the function again), then reads each candidate's round program
from its jaxpr, without compiling anything (`_cost.cost`): candidates that vmap would turn into
grouped convolutions (per-client weights feeding a convolution, on CPU) or whose memory is over
the budget are ruled out, and the cost model's favourite of the rest is picked (`_pick`): vmap
(on a TPU, per_client where each client's share of the round is large: `AUTO_TPU_CLIENT_FLOPS`),
unless another needs clearly fewer operations (`AUTO_MARGIN`). Nothing is compiled or run but
the call itself, whose program is kept, whatever was picked. With `AUTO_TIMING` the candidates
left are timed instead (`_timing`), within `AUTO_TIME_BOX`. Each decision is also kept on disk
(`_decisions`), so the next process reads it. The settings (`settings`) are read at each
decision; `map_reduce_choices` lists what was picked and why.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import torch

from bridge_mr import _caches, dlpack, jax_core
from bridge_mr._compat import torch as torch_compat

from . import _decisions, _device, _pick, _reading, _report, settings
from ._kind import RoundKind
from ._report import Choice, Option
from ._timing import time_candidates

_MAX_CHOICES = 256
_LOG = logging.getLogger("bridge_mr")

# The choices by call signature (the compile key with the strategy left out).
_CHOICES: _caches.Bounded[Hashable, Choice] = _caches.register(
    "map_reduce auto choices", _caches.Bounded(_MAX_CHOICES)
)
_DECIDING = threading.RLock()  # Held while deciding: one decision at a time.


def forget_choices() -> None:
    """Forgets every choice of `auto` held in memory.

    The next call of each signature decides again (reading the decision kept on disk, if any:
    `forget_all` deletes those).

    Example:
      >>> bridge_mr.map_reduce(jax_loss, params, batch).backward()  # strategy="auto" decides
      >>> bridge_mr.auto.forget_choices()
      >>> bridge_mr.map_reduce_choices()
      []
    """
    _CHOICES.clear()


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
    return list(_CHOICES.values())


def choose(
    key: Hashable,
    tensors: Sequence[torch.Tensor],
    args: tuple[Any, ...],
    budget: int | None,
    kind: RoundKind,
) -> Option:
    """The (strategy, chunk_size) for a call with `strategy="auto"`: kept, else decided.

    Args:
      key: the call's signature (its compile key without the strategy).
      tensors: the call's tensors, in the key's order.
      args: the round's positional arguments before the strategy (`fn, server, clients,
        weights, reduce, placement, mesh or layout`).
      budget: the `memory_budget_bytes=` argument, or None.
      kind: how to run and measure the round.

    Returns:
      The strategy and chunk size to run the call with (vmap where nothing can be measured
      now, or the arguments are bad: the call then says how).
    """
    choice = _CHOICES.get(key)
    if choice is not None:
        return choice.strategy, choice.chunk_size
    if not _measurable(tensors):
        return "vmap", None
    with _DECIDING:
        choice = _CHOICES.get(key)
        if choice is None:
            choice = _decide(args, tensors, budget, kind)
            if choice is None:
                return "vmap", None
            _CHOICES.put(key, choice)
    return choice.strategy, choice.chunk_size


def _measurable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether timing calls now means something: torch CPU, CUDA or TorchTPU tensors (not
    torch-xla's lazy ones), no transform."""
    if not tensors or any(t.device.type not in ("cpu", "cuda", "tpu") for t in tensors):
        return False
    return not (torch_compat.functorch_transforms_active() or torch_compat.forward_ad_active())


def _decide(
    args: tuple[Any, ...], tensors: Sequence[torch.Tensor], budget: int | None, kind: RoundKind
) -> Choice | None:
    """The choice for a new signature: read from disk, else decided; None for bad arguments."""
    started = time.perf_counter()
    fn, server, clients, _, reduce, placement, mesh = args
    grads = [t for t in tensors if torch.is_grad_enabled() and t.requires_grad]
    signature = _report.describe(fn, server, clients, reduce, bool(grads))
    n = _reading.client_count(clients)
    try:
        specs = _reading.specs(args, kind.across_processes)
        # Across processes the round's placement is the global client count (the specs').
        rows = jax.tree.leaves(specs[1])[0].shape[0] if kind.across_processes else n
        client = kind.trace_client(fn, *_reading.one_client(specs), placement, rows)
    except Exception:  # The call raises again, with the bridge's message.
        return None
    on = None if mesh is not None or kind.across_processes else dlpack.host_program_device()
    if on is not None and tensors[0].device.type == "cpu":
        device = _device.describe_program_device(on)
    else:
        device = _device.describe(tensors[0].device)
    disk = None
    if not kind.across_processes:
        found = _decisions.fingerprint(client.jaxpr, args, specs, tensors, budget, device)
        disk = _decisions.name(found)
        record = _decisions.load(disk)
        choice = _report.from_record(record, signature) if record is not None else None
        if choice is not None:
            seconds = time.perf_counter() - started
            _LOG.debug("map_reduce(strategy='auto') for %s: %s, kept on disk", signature, choice)
            return dataclasses.replace(choice, measure_seconds=seconds)
    if kind.across_processes:
        mesh = None  # The layout: the program's own mesh has an Auto placement axis.
    options: list[Option] = [("vmap", None)]
    if not _reading.explicit_placement(placement, mesh):  # Which only vmap supports.
        chunks: list[Option] = [("chunks", k) for k in settings.AUTO_CHUNK_SIZES if k < n]
        options += [("per_client", None), *chunks]
        packed = settings.AUTO_TPU_PACKED
        no_mesh = mesh is None and jax_core.ambient_mesh() is None
        if device.platform == "tpu" and packed is not None and packed < n and no_mesh:
            options.append(("packed", packed))
    costs = {o: _reading.round_cost(kind.program, args, specs, o, bool(grads)) for o in options}
    budget = _pick.memory_budget(budget, costs, device, kind)
    skipped = _pick.ruled_out(costs, budget, device)
    first = _pick.per_client_first(costs, device, rows)
    ranked = _pick.ranked([o for o in options if o not in skipped], costs, first)
    if settings.AUTO_TIMING and len(ranked) > 1:
        times, not_timed = time_candidates(args, ranked, grads, kind, tensors)
        skipped.update(not_timed)
        choice = _pick.pick_timed(options, costs, times, skipped, budget, first)
    else:
        choice = _pick.pick_modelled(options, costs, ranked, skipped, budget, first)
    choice = dataclasses.replace(
        choice, signature=signature, measure_seconds=time.perf_counter() - started
    )
    if disk is not None:
        _decisions.store(disk, _report.record(choice))
    _LOG.debug(
        "map_reduce(strategy='auto') for %s: picked %s (%s); candidates: %s; deciding took %.3f s",
        choice.signature,
        _report.label(choice.strategy, choice.chunk_size),
        choice.reason,
        "; ".join(_report.candidate_text(c) for c in choice.candidates),
        choice.measure_seconds,
    )
    return choice
