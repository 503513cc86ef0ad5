"""What a runner runs and what it is: the seam between the torch frontend and the devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import torch


class Jitted(Protocol):
    """A jitted JAX function over flat arrays returning a flat list of arrays.

    Its inputs are torch tensors followed by *carried* values (results of an earlier program
    on the same kind of runner, such as VJP residuals, which stay on the runner's side).
    """

    def __call__(self, *arrays: Any) -> list[jax.Array]: ...


class Runner(Protocol):
    """Runs one program: torch tensors and carried values in; torch tensors and carried out."""

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]: ...
