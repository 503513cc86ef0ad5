"""What the `from_torch` tests of models share: a module's state, and the comparison with torch.

`close` compares a float32 result of bridge_mr (a loss, a gradient, an output) with torch's at
`RTOL` / `ATOL`: the models' losses and gradients sum over batches and layers in another order
than torch's kernels do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

RTOL, ATOL = 2e-4, 2e-5


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by name (what `functional_call` takes)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def close(actual: Any, expected: Any, what: str) -> None:
    """`actual` (a torch tensor or an array) equals `expected` within `RTOL` / `ATOL`."""
    if not isinstance(actual, torch.Tensor):
        actual = torch.from_numpy(np.array(actual))
    torch.testing.assert_close(
        actual.detach().to(torch.float32),
        torch.as_tensor(expected, dtype=torch.float32).detach(),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )
