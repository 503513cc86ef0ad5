"""Value checks of `map_reduce`'s weights: no NaN or inf, and no zero sum to divide by.

Where the weights live decides when they are checked. CPU tensors (and concrete JAX arrays)
are checked before the program runs. Tensors on a CUDA device are checked by device reductions
queued beside the program; their one-element verdict is read after it, when the bridge waits
for the program's results anyway, so the check adds no device sync of its own. Tensors on a
torch-xla device are checked before the program by materialising the verdict (one small
device-to-host read). Traced JAX values (inside `jax.jit`) cannot be checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.core
import numpy as np
import torch

_OPT_OUT = "pass check_weights=False for raw IEEE results (NaN / inf)"


def check_weights(weights: Any) -> Callable[[], None] | None:
    """Checks `weights` now where that is free; returns the check left for after the program.

    Raises:
      ValueError: a weight is NaN or inf, or the weights of some output element sum to zero.
    """
    deferred = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        name = "weights" + jax.tree_util.keystr(path)
        if isinstance(leaf, torch.Tensor):
            values = leaf.detach()
            if values.device.type == "cuda":
                deferred.append((name, values, _verdict(values)))
            else:
                # torch-xla and TorchTPU: read back the 2-element verdict, not the weights.
                if values.device.type in ("xla", "tpu") and not bool(_verdict(values).any()):
                    continue
                _raise_if_bad(name, values.cpu().numpy())
        elif isinstance(leaf, (np.ndarray, np.generic)) or (
            isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
        ):
            _raise_if_bad(name, np.asarray(leaf))
    if not deferred:
        return None

    def check_after() -> None:
        for name, values, verdict in deferred:
            if bool(verdict.any()):
                _raise_if_bad(name, values.cpu().numpy())

    return check_after


def _verdict(values: torch.Tensor) -> torch.Tensor:
    """[any weight non-finite, any element's weights summing to zero], on the values' device."""
    if values.ndim == 0:
        return torch.zeros(2, dtype=torch.bool, device=values.device)
    non_finite = (
        ~torch.isfinite(values).all()
        if values.is_floating_point()
        else values.new_zeros((), dtype=torch.bool)
    )
    zero_sum = (values.sum(0) == 0).any()
    return torch.stack([non_finite, zero_sum])


def _raise_if_bad(name: str, values: np.ndarray) -> None:
    if values.ndim == 0:
        return  # Shape errors are reported with the program's other shape checks.
    if values.dtype == np.bool_:
        values = values.astype(np.int64)
    bad = ~np.isfinite(values) if np.issubdtype(values.dtype, np.inexact) else None
    if bad is not None and bad.any():
        where = np.argwhere(bad)
        shown = ", ".join(
            f"{values[tuple(i)]} at client {i[0]}"
            + (f" index {tuple(i[1:])}" if len(i) > 1 else "")
            for i in where[:3]
        )
        raise ValueError(
            f"map_reduce(weights): {name} has {len(where)} non-finite value(s) ({shown}); a "
            "weighted mean with a NaN or inf weight is NaN, and so are its gradients. Give "
            f"those clients finite weights (0 drops a client), or {_OPT_OUT}."
        )
    sums = values.sum(0)
    zero = np.argwhere(np.asarray(sums) == 0)
    if len(zero):
        if values.ndim == 1:
            listed = np.array2string(values, threshold=8, separator=", ")
            what = f"{name} sum to zero ({listed})"
        else:
            what = (
                f"the weights in {name} sum to zero over the clients at {len(zero)} of "
                f"{sums.size} output positions (first {tuple(zero[0])})"
            )
        raise ValueError(
            f"map_reduce(weights): {what}; the weighted mean sum(x·w) / sum(w) would divide "
            "by zero. Pass weights with a nonzero sum (e.g. the clients' example counts, with "
            f"at least one client of nonzero weight), or {_OPT_OUT}."
        )
