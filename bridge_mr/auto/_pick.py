"""How `auto` picks among its candidates: the memory budget, what the cost model rules out,
its ranking, and the pick (modelled, or timed with `AUTO_TIMING`)."""

from __future__ import annotations

import math

from . import _report, settings
from ._cost import Cost
from ._device import DeviceDescription
from ._kind import RoundKind
from ._report import Choice, Option

_RULED_OUT_GROUPED = (
    "ruled out: it would vmap the client's convolutions over per-client weights, a grouped "
    "convolution (clients x channels), which XLA:CPU runs several times slower"
)
_RULED_OUT_GROUPED_TPU = (
    "ruled out: it would vmap the client's convolutions over per-client weights into "
    "convolutions of more groups than AUTO_TPU_MAX_CONV_GROUPS, which a TPU runs slower per "
    "client than one client at a time"
)
_RULED_OUT_GROUPED_TORCH_TPU = (
    "ruled out: it would vmap the client's convolutions over per-client weights into "
    "convolutions of more groups than AUTO_TORCH_TPU_MAX_CONV_GROUPS (TorchTPU's TPU)"
)
_RULED_OUT_GROUPED_GPU = (
    "ruled out: it would vmap the client's convolutions over per-client weights into "
    "convolutions of more groups than AUTO_GPU_MAX_CONV_GROUPS, which a GPU runs slower per "
    "client than smaller chunks"
)
_OVER_BUDGET = "ruled out: over the memory budget"
_NOTHING_TO_PACK = (
    "ruled out: vmap would group none of the client's convolutions over per-client weights, so "
    "packing the clients runs no convolution densely"
)


def memory_budget(
    budget: int | None,
    costs: dict[Option, Cost | None],
    device: DeviceDescription,
    kind: RoundKind,
) -> int:
    """The memory budget: the caller's, else half the device's; on CPU at most
    `AUTO_MEMORY_FACTOR` times the leanest candidate's estimate when vmap's is over
    `AUTO_MEMORY_FLOOR`."""
    if budget is not None:
        return budget
    budget = kind.agree_budget(device.memory_bytes // 2)
    if device.accelerator:
        return budget
    known = [c.peak_bytes for c in costs.values() if c is not None]
    vmap = costs[("vmap", None)]
    if vmap is not None and vmap.peak_bytes > settings.AUTO_MEMORY_FLOOR and known:
        budget = min(
            budget, max(settings.AUTO_MEMORY_FACTOR * min(known), settings.AUTO_MEMORY_FLOOR)
        )
    return budget


def ruled_out(
    costs: dict[Option, Cost | None], budget: int, device: DeviceDescription
) -> dict[Option, str]:
    """The candidates the cost model rules out on `device`, and why (a candidate it cannot
    read stays): those over the budget, and batched ones whose convolutions vmap groups over
    per-client weights (on CPU any such grouping; on a GPU beyond `AUTO_GPU_MAX_CONV_GROUPS`, on
    a TPU beyond `AUTO_TPU_MAX_CONV_GROUPS`, on TorchTPU's beyond
    `AUTO_TORCH_TPU_MAX_CONV_GROUPS`)."""
    reference = costs.get(("per_client", None))
    vmap = costs.get(("vmap", None))
    packs = reference is not None and vmap is not None and vmap.conv_groups > reference.conv_groups
    on_tpu = device.platform == "tpu"
    on_torch_tpu = device.platform == "torch_tpu"
    torch_tpu_groups = settings.AUTO_TORCH_TPU_MAX_CONV_GROUPS
    out: dict[Option, str] = {}
    for option, found in costs.items():
        if found is None:
            continue
        if option[0] == "packed" and not packs:
            out[option] = _NOTHING_TO_PACK
            continue
        grouped = (
            option[0] != "per_client"
            and reference is not None
            and found.conv_groups > reference.conv_groups
        )
        if grouped and not device.accelerator:
            out[option] = _RULED_OUT_GROUPED
        elif grouped and on_tpu and found.conv_groups > settings.AUTO_TPU_MAX_CONV_GROUPS:
            out[option] = _RULED_OUT_GROUPED_TPU
        elif (
            grouped
            and on_torch_tpu
            and torch_tpu_groups is not None
            and found.conv_groups > torch_tpu_groups
        ):
            out[option] = _RULED_OUT_GROUPED_TORCH_TPU
        elif (
            grouped
            and not (on_tpu or on_torch_tpu)
            and found.conv_groups > settings.AUTO_GPU_MAX_CONV_GROUPS
        ):
            out[option] = _RULED_OUT_GROUPED_GPU
        elif found.peak_bytes > budget:
            out[option] = _OVER_BUDGET
    return out


def per_client_first(
    costs: dict[Option, Cost | None], device: DeviceDescription, clients: int
) -> bool:
    """Whether per_client heads `auto`'s preference: on a TPU (JAX's or TorchTPU's), where
    each client's share of vmap's operations is at least `AUTO_TPU_CLIENT_FLOPS`."""
    vmap = costs.get(("vmap", None))
    return (
        device.platform in ("tpu", "torch_tpu")
        and vmap is not None
        and clients > 0
        and vmap.flops / clients >= settings.AUTO_TPU_CLIENT_FLOPS
    )


def ranked(
    options: list[Option], costs: dict[Option, Cost | None], per_client_first: bool
) -> list[Option]:
    """`options` in `auto`'s preference (vmap, larger chunks, per_client; per_client first
    where `per_client_first`), the cost model's favourite first: the first that needs fewer
    than `AUTO_MARGIN` times the operations of every one preferred to it. A "packed" option
    (only offered on a TPU, see `AUTO_TPU_PACKED`) comes first whatever its count: it does
    more operations (the zero blocks) in fewer, wider products, which measured faster."""
    packed = [p for p in options if p[0] == "packed"]
    if packed:
        return [*packed, *ranked([p for p in options if p[0] != "packed"], costs, per_client_first)]
    order = sorted(
        options, key=lambda p: ((p[0] == "per_client") != per_client_first, -(p[1] or math.inf))
    )
    if not order:
        return order
    best = order[0]
    for option in order[1:]:
        mine, theirs = costs[option], costs[best]
        if (
            mine is not None
            and theirs is not None
            and mine.flops < settings.AUTO_MARGIN * theirs.flops
        ):
            best = option
    return [best, *(p for p in order if p != best)]


def pick_modelled(
    options: list[Option],
    costs: dict[Option, Cost | None],
    ranked: list[Option],
    skipped: dict[Option, str],
    budget: int,
    per_client_first: bool,
) -> Choice:
    """The cost model's favourite, untimed (or the leanest, when all are over the budget);
    `per_client_first`: as `ranked` was given it (for the reason)."""
    if not ranked:
        return leanest(options, costs, skipped, budget)
    best = ranked[0]
    for option in ranked[1:]:
        skipped[option] = f"not timed: the cost model prefers {_report.label(*best)}"
    if len(ranked) == 1:
        reason = "the only candidate the cost model did not rule out"
    elif best[0] == "vmap":
        reason = (
            f"the cost model: no candidate needs {1 - settings.AUTO_MARGIN:.0%} fewer operations"
        )
    elif best[0] == "packed":
        reason = (
            "on a TPU, convolutions over per-client weights run fastest with AUTO_TPU_PACKED "
            "clients packed into their channels"
        )
    elif per_client_first and best[0] == "per_client":
        reason = (
            "a TPU runs one client at a time faster where each client's share of the round is "
            f"at least AUTO_TPU_CLIENT_FLOPS operations, and no candidate needs "
            f"{1 - settings.AUTO_MARGIN:.0%} fewer"
        )
    else:
        reason = (
            f"the cost model: it needs {1 - settings.AUTO_MARGIN:.0%} fewer operations than those "
            "preferred to it"
        )
    candidates = _report.candidates(options, costs, skipped, {})
    return Choice("", best[0], best[1], reason, candidates, budget, 0.0)


def leanest(
    options: list[Option], costs: dict[Option, Cost | None], skipped: dict[Option, str], budget: int
) -> Choice:
    """Every candidate ruled out: the one needing the least memory."""
    best = min(options, key=lambda p: math.inf if costs[p] is None else costs[p].peak_bytes)  # type: ignore[union-attr]
    reason = "every candidate is over the memory budget: the one needing the least memory"
    if any(s in (_RULED_OUT_GROUPED, _RULED_OUT_GROUPED_GPU) for s in skipped.values()):
        reason = "every candidate is ruled out: the one needing the least memory"
    candidates = _report.candidates(options, costs, skipped, {})
    return Choice("", best[0], best[1], reason, candidates, budget, 0.0)


def pick_timed(
    options: list[Option],
    costs: dict[Option, Cost | None],
    times: dict[Option, list[float]],
    skipped: dict[Option, str],
    budget: int,
    per_client_first: bool,
) -> Choice:
    """The fastest timed candidate; the preference's head ("packed" where offered, per_client
    where `per_client_first`, else vmap) unless another is clearly (`AUTO_MARGIN`) faster."""
    candidates = _report.candidates(options, costs, skipped, times)
    timed = [c for c in candidates if c.seconds is not None]
    best = min(timed, key=lambda c: c.seconds or 0.0)
    head = "per_client" if per_client_first else "vmap"
    if any(o[0] == "packed" and o not in skipped for o in options):
        head = "packed"
    preferred = next((c for c in timed if c.strategy == head), None)
    if preferred is None:
        reason = f"the fastest of those timed ({head} was ruled out)"
    elif best is preferred:
        reason = "the fastest"
    elif (best.seconds or 0.0) < settings.AUTO_MARGIN * (preferred.seconds or 0.0):
        reason = f"faster than {head} by more than {1 - settings.AUTO_MARGIN:.0%}"
    else:
        best = preferred
        reason = f"no candidate beats {head} by more than {1 - settings.AUTO_MARGIN:.0%}"
    return Choice("", best.strategy, best.chunk_size, reason, candidates, budget, 0.0)
