"""How `auto` times its candidates (`AUTO_TIMING`): each one's calls, with the backward pass
the caller would run, within a time box."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from bridge_mr.typing import PyTree

from . import settings
from ._kind import RoundKind
from ._report import Option

TOO_FAST = "not tried: vmap takes under AUTO_MIN_SECONDS"

# Device types whose torch ops run asynchronously: timing waits for them.
_ASYNC = ("cuda", "tpu")


def time_candidates(
    args: tuple[Any, ...],
    ranked: list[Option],
    grads: Sequence[torch.Tensor],
    kind: RoundKind,
    tensors: Sequence[torch.Tensor],
) -> tuple[dict[Option, list[float]], dict[Option, str]]:
    """Times `ranked` in order (`AUTO_TIMING`): each one's first call (which compiles, and whose
    program `kind.keeping` keeps), one timed call, then more calls for those that can still
    win; within `AUTO_TIME_BOX`. Returns the times and why the others were not timed."""
    device = next((t.device for t in tensors if t.device.type in _ASYNC), None)
    times: dict[Option, list[float]] = {}
    calls: dict[Option, Callable[[], None]] = {}
    skipped: dict[Option, str] = {}
    first = spent = 0.0
    for option in ranked:
        if (
            option != ranked[0]
            and ranked[0][0] == "vmap"
            and times[ranked[0]][0] < settings.AUTO_MIN_SECONDS
        ):
            skipped[option] = TOO_FAST
            continue
        if option != ranked[0] and spent > settings.AUTO_TIME_BOX * first:
            skipped[option] = "not timed: over AUTO_TIME_BOX (the cost model's favourite is kept)"
            continue

        def call(option: Option = option) -> None:
            backward(kind.keeping(*args, *option), grads)

        seconds = kind.agree_seconds(timed(call, device))  # Traces and compiles.
        first = first or seconds
        times[option] = [kind.agree_seconds(timed(call, device))]
        spent += seconds + times[option][0]
        calls[option] = call
    best = min(t[0] for t in times.values())
    for option, found in times.items():
        while len(found) < settings.AUTO_REPEATS and found[-1] <= settings.AUTO_GIVE_UP * best:
            found.append(kind.agree_seconds(timed(calls[option], device)))
    return times, skipped


def backward(out: PyTree, grads: Sequence[torch.Tensor]) -> None:
    """The backward pass the caller would run, without touching any `.grad`."""
    if not grads:
        return
    outputs = [o for o in jax.tree.leaves(out) if o.requires_grad]
    if outputs:
        torch.autograd.grad(
            outputs, list(grads), [torch.ones_like(o) for o in outputs], allow_unused=True
        )


def timed(call: Callable[[], None], device: torch.device | None) -> float:
    """Seconds one `call` takes (synchronising `device`, a CUDA or TorchTPU device whose ops
    run asynchronously, if any, before and after)."""
    _synchronize(device)
    start = time.perf_counter()
    call()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device | None) -> None:
    if device is None:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        torch.accelerator.synchronize(device)
