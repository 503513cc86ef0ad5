"""Yogi (Zaheer et al., 2018), the server optimizer of FedYogi (Reddi et al., 2021)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Yogi(torch.optim.Optimizer):
    """The Yogi optimizer, as torch.optim has none: FedYogi's server optimizer.

    Per parameter, with gradient g (for FedYogi: minus the mean client delta)::

        m = beta1 * m + (1 - beta1) * g
        v = v - (1 - beta2) * g**2 * sign(v - g**2)
        p = p - lr * m / (sqrt(v) + eps)

    m starts at 0 and v at `initial_accumulator_value`, without bias correction, as in
    Algorithm 2 of Reddi et al., "Adaptive Federated Optimization" (their tau is `eps`, and
    v_{-1} >= tau**2 is the default 1e-6).

    Args:
      params: the parameters (or parameter groups) to optimize.
      lr: the learning rate, > 0.
      betas: (beta1, beta2), each in [0, 1).
      eps: added to sqrt(v), > 0 (FedYogi's adaptivity tau).
      initial_accumulator_value: v's initial value, >= 0.

    Raises:
      ValueError: an argument outside its range.

    Example:
      >>> server_opt = alg.Yogi(params.values(), lr=0.01)  # e.g. model.parameters()
      >>> metrics = alg.outer_step(local, params, batches)
      >>> server_opt.step()
      >>> bool(params["b"] > 0)  # the server moved towards the clients' targets (1)
      True
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-3,
        initial_accumulator_value: float = 1e-6,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"Yogi(lr=...): expected a number > 0, got {lr!r}.")
        if not all(0 <= b < 1 for b in betas) or len(betas) != 2:
            raise ValueError(f"Yogi(betas=...): expected two numbers in [0, 1), got {betas!r}.")
        if not eps > 0:
            raise ValueError(f"Yogi(eps=...): expected a number > 0, got {eps!r}.")
        if not initial_accumulator_value >= 0:
            raise ValueError(
                "Yogi(initial_accumulator_value=...): expected a number >= 0, got "
                f"{initial_accumulator_value!r}."
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "initial_accumulator_value": initial_accumulator_value,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Takes one Yogi step for every parameter with a gradient.

        Args:
          closure: optional, re-evaluates the model and returns the loss.

        Returns:
          The closure's loss, or None.

        Example:
          >>> w = torch.zeros(2, requires_grad=True)
          >>> optimizer = alg.Yogi([w], lr=0.1)
          >>> w.grad = torch.tensor([1.0, -1.0])
          >>> optimizer.step()
          >>> w
          tensor([-0.0990,  0.0990], requires_grad=True)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.full_like(p, group["initial_accumulator_value"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g2 = g * g
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.addcmul_(torch.sign(v - g2), g2, value=-(1 - beta2))
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])
        return loss
