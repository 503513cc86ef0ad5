"""The autograd side of a call: one autograd node, one apply, and the backward strategies.

A call signature's `Entry` holds its traced call, the runner of its forward program (chosen
once, by device) and its `Backward`:

* fused (a float scalar output): forward also computed the gradients; backward scales them
  (and hands them to `AccumulateGrad` without a copy);
* residual (anything else): forward returned the VJP residuals, which stay JAX arrays on the
  runner's side; backward runs the compiled VJP over them;
* recompute (`create_graph=True`, or a second backward through a fused call whose gradients
  the first one handed over): a differentiable torch function of the VJP from the inputs.

`apply` is the one way a call runs. The `torch.compile` path (`_custom_op`) shares the
cotangent fill and the gradient scaling defined here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from bridge_mr import runners
from bridge_mr._compat import torch as torch_compat
from bridge_mr._dtypes import is_differentiable, torch_dtype

from ._traced import (
    Outputs,
    TracedCall,
    jvp_from_inputs,
    residual_runner,
    vjp_from_inputs,
)

#: Makes a differentiable torch function of a JAX function, named for errors.
TorchFunctionFactory = Callable[[Callable[..., Any], str], Callable[..., Any]]


class Backward:
    """How backward runs for one traced call (fused, residual; recompute when it must).

    The compiled VJP over residuals and the torch functions of the VJP and JVP are built at
    their first use.
    """

    def __init__(self, traced: TracedCall, make_function: TorchFunctionFactory) -> None:
        self._traced = traced
        self._make_function = make_function
        self._lock = threading.Lock()
        self._runner: runners.Runner | None = None
        self._vjp: Callable[..., Any] | None = None
        self._jvp: Callable[..., Any] | None = None

    def __call__(self, call: _Call, grad_outputs: Sequence[torch.Tensor]) -> list[Any]:
        """Gradients for every tensor input of `call` (None where none is needed)."""
        traced = self._traced
        cotangents = [grad_outputs[i] for i in traced.outputs.float_outputs]
        if torch.is_grad_enabled() or call.saved is None:
            call.check_versions()
            grads = self.vjp()(list(call.tensors), cotangents, list(call.arrays))
        elif traced.outputs.fused:
            # Keeping no reference lets AccumulateGrad adopt the gradients as .grad uncopied.
            grads, call.saved = call.saved, None
            grads = scale_gradients(grads, cotangents[0], skip_unit=True)
        else:
            grads, _ = self.runner()(cotangents, call.saved)
        return scatter(traced.spec.diff, grads, len(call.tensors))

    def runner(self) -> runners.Runner:
        """The runner of the compiled VJP over residuals."""
        if self._runner is None:
            with self._lock:
                if self._runner is None:
                    self._runner = residual_runner(self._traced)
        return self._runner

    def vjp(self) -> Callable[..., Any]:
        """The VJP (inputs, float cotangents) -> gradients as a differentiable torch function."""
        _single_process(self._traced, "create_graph=True (or a second backward)")
        if self._vjp is None:
            with self._lock:
                if self._vjp is None:
                    self._vjp = self._make_function(
                        vjp_from_inputs(self._traced), f"the VJP of {self._traced.spec.name}"
                    )
        return self._vjp

    def jvp(
        self, primals: Sequence[torch.Tensor], tangents: Sequence[Any], arrays: Sequence[Any]
    ) -> list[Any]:
        """Tangents of the outputs (None for non-float ones) given tangents of the inputs
        (`arrays`: the call's JAX array inputs)."""
        traced = self._traced
        in_avals = traced.spec.in_avals
        positions = tuple(
            i for i, t in enumerate(tangents) if t is not None and is_differentiable(in_avals[i][1])
        )
        _single_process(traced, "forward-mode AD (torch.func.jvp, dual tensors)")
        given = [tangents[i].to(primals[i].dtype) for i in positions]
        if self._jvp is None:
            with self._lock:
                if self._jvp is None:
                    self._jvp = self._make_function(
                        jvp_from_inputs(traced), f"the JVP of {traced.spec.name}"
                    )
        out = iter(self._jvp(list(primals), given, positions, list(arrays)))
        floats = frozenset(traced.outputs.float_outputs)
        return [next(out) if i in floats else None for i in range(traced.outputs.n_out)]


def _single_process(traced: TracedCall, what: str) -> None:
    """Raises where `what`, which recomputes from the inputs, meets a call across processes."""
    if traced.spec.layout is not None:
        raise NotImplementedError(
            f"{traced.spec.name}: {what} is not supported across processes (it would rerun "
            "the cross-process program from each rank's inputs). Use one backward per call "
            "(loss.backward()), as with DDP, or differentiate inside the JAX function."
        )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One call signature: its traced call, its forward runner and its backward."""

    traced: TracedCall
    forward: runners.Runner
    backward: Backward


def run(entry: Entry, tensors: list[torch.Tensor], arrays: Sequence[Any] = ()) -> Any:
    """Runs a call of `entry` on its tensors (and JAX array inputs); its outputs in the traced
    function's structure."""
    outputs = apply(entry, tensors, arrays)
    found = entry.traced.outputs
    if found.is_leaf:
        return outputs[0]
    return jax.tree_util.tree_unflatten(found.tree, outputs)


def apply(
    entry: Entry, tensors: list[torch.Tensor], arrays: Sequence[Any] = ()
) -> Sequence[torch.Tensor]:
    """Runs one call: through the autograd node when an input needs gradients, else directly.
    `arrays`: the call's JAX array inputs, passed to its programs as they are."""
    if torch_compat.functorch_transforms_active() or torch_compat.forward_ad_active():
        # torch.func transforms and forward-mode AD (dual tensors) need the Python apply.
        return JaxCall.apply(_Call(entry, tensors, arrays, forward_mode=True), *tensors)
    if entry.traced.spec.diff:
        return _apply(_Call(entry, tensors, arrays), *tensors)
    outputs, _ = entry.forward(tensors, arrays)
    return outputs


def scale_gradients(
    grads: list[torch.Tensor], scale: torch.Tensor, *, skip_unit: bool
) -> list[torch.Tensor]:
    """Gradients of a fused call for the cotangent `scale` of its scalar output.

    With `skip_unit`, a CPU scale of exactly 1 (a loss's `.backward()`) returns `grads` as they
    are (reading the scale is free on CPU); the compiled path cannot read values and scales.
    """
    if skip_unit and scale.device.type == "cpu" and scale.item() == 1.0:
        return grads
    return [g * scale.to(g.dtype) for g in grads]


def fill_cotangents(
    outputs: Outputs, grad_outputs: Sequence[torch.Tensor | None], device: torch.device
) -> list[torch.Tensor]:
    """The cotangents of the float outputs, zeros where autograd gave None."""
    filled = []
    for i in outputs.float_outputs:
        grad = grad_outputs[i]
        if grad is None:
            shape, dtype = outputs.avals[i]
            grad = torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
        filled.append(grad)
    return filled


def scatter(diff: tuple[int, ...], grads: Sequence[Any], n: int) -> list[Any]:
    """One gradient slot per input: `grads` at the positions in `diff`, None elsewhere."""
    result: list[Any] = [None] * n
    for i, grad in zip(diff, grads, strict=True):
        result[i] = grad
    return result


class _Call:
    """One differentiable call: its entry, inputs, and what backward needs from forward."""

    __slots__ = ("arrays", "entry", "forward_mode", "saved", "tensors", "versions")

    def __init__(
        self,
        entry: Entry,
        tensors: list[torch.Tensor],
        arrays: Sequence[Any] = (),
        *,
        forward_mode: bool = False,
    ) -> None:
        # Only the Python apply (torch.func, forward-mode AD) may need primals for jvp: saving
        # them costs every other differentiable call a little.
        self.forward_mode = forward_mode
        self.entry = entry
        self.tensors = tensors
        self.arrays = arrays  # JAX arrays: immutable, nothing to check.
        self.versions = list(map(torch_compat.version_of, tensors))
        self.saved: list[Any] | None = []

    def check_versions(self) -> None:
        """Raises if an input changed in place since forward (recomputing reads the inputs)."""
        now = list(map(torch_compat.version_of, self.tensors))
        for i, (tensor, version, current) in enumerate(
            zip(self.tensors, self.versions, now, strict=True)
        ):
            if current != version:
                raise RuntimeError(
                    f"{self.entry.traced.spec.name}: tensor input {i} (shape "
                    f"{tuple(tensor.shape)}) was modified in place after the call (version "
                    f"{version} -> {current}); this backward (with create_graph=True, "
                    "or a second one through retain_graph=True) recomputes from the inputs and "
                    "needs their original values. Clone the tensor before modifying it, or run "
                    "backward first."
                )


class JaxCall(torch.autograd.Function):
    """The one autograd node of a torch function call; the first input carries the call state."""

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entry = call.entry
        exported, carried = entry.forward(tensors, call.arrays)
        n = entry.traced.outputs.n_out
        call.saved = exported[n:] if entry.traced.outputs.fused else carried
        return tuple(exported[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        call = inputs[0]
        ctx.call = call
        if call.forward_mode:
            ctx.save_for_forward(*inputs[1:])
        non_diff = call.entry.traced.outputs.non_diff_outputs
        if non_diff:
            ctx.mark_non_differentiable(*(output[i] for i in non_diff))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        call = ctx.call
        return (None, *call.entry.backward(call, grad_outputs))

    @staticmethod
    def jvp(ctx: Any, *grad_inputs: torch.Tensor | None) -> tuple[Any, ...]:
        # One tangent per forward input: the first is the call state's (None).
        call = ctx.call
        return tuple(call.entry.backward.jvp(ctx.saved_tensors, grad_inputs[1:], call.arrays))

    @staticmethod
    def vmap(info: Any, in_dims: Any, *args: Any) -> Any:
        call: _Call = args[0]
        raise NotImplementedError(
            f"torch.func.vmap over {call.entry.traced.spec.name} is not supported (nor jacfwd, "
            "jacrev and hessian, which use it): JAX cannot see torch's batching. Batch inside "
            "JAX instead: jax.vmap (or jax.jacfwd / jax.jacrev) in the JAX function, or map_fn "
            "over a placement."
        )


_apply = torch_compat.autograd_apply(JaxCall)
