"""Runs programs on TorchTPU tensors (torch device "tpu"): the round stays on the chip.

In a process where TorchTPU (`torch_tpu`) holds the chip, JAX only traces and exports:
each program is exported once per signature for the TPU (`jax.export`, StableHLO) and run by
TorchTPU on the "tpu" tensors themselves (`bridge_mr._compat.torch_tpu`), with its results new
"tpu" tensors. No DLPack and no host round trip; carried values (a VJP's residuals) are "tpu"
tensors too. JAX must stay off the chip there (`JAX_PLATFORMS=cpu`): one process at a time
can hold it, and TorchTPU does.

64-bit integers while `jax_enable_x64` is off: an int64 / uint64 tensor given for an int32 /
uint32 input crosses as its 32-bit words (a view), and the program itself narrows it and says
whether every value fit: one device read per call, after the program, for all such tensors
together (before, a check and a cast in torch took about 3 ms of a GPT-2 round). A value that
does not fit raises the error torch-xla's runner raises. Cast labels to int32 yourself to
avoid the read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr import _dtypes, jax_core
from bridge_mr._compat import torch_tpu as torch_tpu_compat
from bridge_mr._dtypes import Aval

from ._narrowing import as_pairs, from_pairs, narrow, narrowable
from ._protocols import Jitted

# The name of every kernel bridge_mr registers with TorchTPU (each told apart by its program's
# fingerprint).
_NAME = "bridge_mr_program"

#: The XLA options TorchTPU compiles bridge_mr's programs with. At TorchTPU's own level the
#: call of a 50-client CNN FedAvg round's program took 67 ms on a v5e, and GPT-2's 19 ms (each
#: with a 2-3 ms int64 check); at "O3" 50 and 8.6 ms; JAX ran the same exported modules in 47
#: and 5.2-6.1 ms (docs/tpu.md).
COMPILER_OPTIONS = {"xla_optimization_level": "O3"}


def check_jax_off_the_chip() -> None:
    """Raises unless JAX in this process is kept to the CPU, as it must be beside TorchTPU.

    Raises:
      RuntimeError: JAX may start a TPU backend here (`jax_platforms` is not "cpu").
    """
    platforms = jax.config.values.get("jax_platforms") or ""
    if {p.strip() for p in platforms.split(",") if p.strip()} != {"cpu"}:
        raise RuntimeError(
            "bridge_mr: TorchTPU tensors run their programs through TorchTPU, which holds the "
            "chip; JAX in this process may only trace and export, but jax_platforms is "
            f"{platforms or 'unset'} (JAX would open the TPU, which one process at a time can "
            "hold). Fix: set JAX_PLATFORMS=cpu in the environment before Python starts (or "
            "jax.config.update('jax_platforms', 'cpu') before JAX's first computation)."
        )


def trace_context() -> contextlib.AbstractContextManager[None]:
    """The JAX context TorchTPU programs are traced and exported in: programs for the TPU.

    Raises:
      RuntimeError: JAX may open the TPU in this process (`check_jax_off_the_chip`), checked
        before anything is traced (a trace may start JAX's backend).
    """
    check_jax_off_the_chip()
    return jax_core.programs_for("tpu")


class TorchTpuRunner:
    """Runs one program on TorchTPU tensors; carried values are "tpu" tensors.

    The program is exported for the TPU once, at construction, and registered with TorchTPU,
    which compiles it on the first call, with `COMPILER_OPTIONS` (XLA's full optimization
    level: TorchTPU's default level ran these programs 1.35-2.2x slower).

    Args:
      jitted: the jitted program.
      in_avals: shapes and dtypes of its inputs (tensors, then carried values).
      n_exported: how many leading outputs are returned as exported; the rest are carried.
      names: what the errors of the int32 / uint32 range check call each tensor input (see
        `runner_for`); default `tensors[i]`.

    Raises:
      RuntimeError: JAX may open the TPU in this process (`check_jax_off_the_chip`).
      ImportError: torch_tpu is missing or of a version bridge_mr was not checked on.
      TypeError: an output or a carried value has a dtype torch lacks (a typed PRNG key).
    """

    def __init__(
        self,
        jitted: Jitted,
        in_avals: Sequence[Aval],
        n_exported: int,
        names: Sequence[str] | None = None,
    ) -> None:
        if not in_avals:
            raise ValueError("TorchTpuRunner: a program runs on TorchTPU tensors, and has none")
        check_jax_off_the_chip()  # Before torch_tpu's version: the first thing to fix.
        self._kernels = torch_tpu_compat.kernels()
        self._jitted = jitted
        self._in_avals = list(in_avals)
        self._n_exported = n_exported
        self._names = names
        self._plain = self._register(jitted, self._in_avals)
        # The inputs a 64-bit tensor may be given for, of those the exported module takes
        # (jax.jit drops those the program never reads: their values then need no check).
        kept = self._plain.kept
        self._narrowable = tuple(i for i in narrowable(in_avals) if kept is None or i in kept)
        # Programs that take such tensors' 32-bit words, by which inputs are given so.
        self._widened: dict[tuple[int, ...], _Program] = {}

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        given = [*tensors, *carried]
        wide = tuple(i for i in self._narrowable if _dtypes.narrowed(given[i].dtype) is not None)
        if not wide:
            return self._run(self._plain, given)
        if any(_dtypes.narrowed(given[i].dtype) != self._torch_dtype(i) for i in wide):
            return self._run(self._plain, narrow(given, self._narrowable, self._names))
        program = self._widened.get(wide)
        if program is None:
            program = self._widened[wide] = self._widen(wide)
        inputs = [as_pairs(t) if i in wide else t for i, t in enumerate(given)]
        exported, saved = self._run(program, inputs)
        fits = saved.pop().cpu().tolist()  # The one device read of the call.
        if not all(fits):
            unfit = [i for i, ok in zip(wide, fits, strict=True) if not ok]
            narrow(given, unfit, self._names)  # Raises, naming the tensor and its values.
            raise RuntimeError(
                f"bridge_mr: the program found values of the 64-bit tensor inputs {unfit} "
                "that do not fit 32 bits, but their minimum and maximum read back do fit: a "
                "bug in bridge_mr or TorchTPU (please report it). Cast them to int32 yourself "
                "to go on."
            )
        return exported, saved

    def _torch_dtype(self, index: int) -> torch.dtype:
        return _dtypes.torch_dtype(self._in_avals[index][1])

    def _register(self, fn: Any, in_avals: Sequence[Aval]) -> _Program:
        """Exports `fn` for the TPU and registers it with TorchTPU (once per fingerprint)."""
        with trace_context():  # As traced (JAX's trace cache then serves the export); checks JAX.
            exported = jax.export.export(fn, platforms=("tpu",))(
                *(jax.ShapeDtypeStruct(*aval) for aval in in_avals)
            )
        n = self._n_exported
        out_avals = [_torch_aval(i, a, n) for i, a in enumerate(exported.out_avals)]
        serialized = exported.mlir_module_serialized
        # Kernels are TorchTPU's by (name, fingerprint): the same program is registered (and
        # compiled) once, whichever runner exports it.
        fingerprint = hashlib.blake2b(serialized, digest_size=16).hexdigest()
        if not self._kernels.lookup(_NAME, fingerprint):
            self._kernels.register(_NAME, fingerprint, serialized_mlir_module=serialized)
        kept = exported.module_kept_var_idx
        return _Program(fingerprint, out_avals, None if len(kept) == len(in_avals) else kept)

    def _widen(self, wide: tuple[int, ...]) -> _Program:
        """The program taking the inputs at `wide` as 32-bit words (`as_pairs`), which it checks
        and narrows itself; its last output says, per such input, whether all its values fit."""
        jitted, avals = self._jitted, list(self._in_avals)
        targets = {i: avals[i][1] for i in wide}
        for i in wide:
            avals[i] = ((*avals[i][0], 2), np.dtype(np.int32))

        def widened(*args: Any) -> Any:
            narrowed, fits = list(args), []
            for i in wide:
                narrowed[i], ok = from_pairs(args[i], targets[i])
                fits.append(ok)
            return jitted(*narrowed), jnp.stack(fits).astype(jnp.int32)

        return self._register(jax.jit(widened), avals)

    def _run(self, program: _Program, inputs: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
        device = inputs[0].device
        if program.kept is not None:
            inputs = [inputs[i] for i in program.kept]
        placeholders = program.placeholders.get(device)
        if placeholders is None:
            placeholders = [torch.empty(s, dtype=d, device=device) for s, d in program.out_avals]
            program.placeholders[device] = placeholders
        # Around every call, not only the first (which compiles): the options may key
        # TorchTPU's executables.
        self._kernels.push_options(COMPILER_OPTIONS)
        try:
            outputs = list(
                self._kernels.call(
                    _NAME,
                    program.fingerprint,
                    inputs=inputs,
                    output_shapes=placeholders,
                    donate_argnums=[],
                    device_assignment=[],
                )
            )
        finally:
            self._kernels.pop_options()
        n = self._n_exported
        return outputs[:n], outputs[n:]


@dataclasses.dataclass
class _Program:
    """One exported program as TorchTPU runs it: its kernel's fingerprint, its results' shapes
    and dtypes, the inputs its module takes (None: all), and its results' placeholders per
    device (TorchTPU allocates results itself; torch_tpu's own `jax_op` keeps them so too)."""

    fingerprint: str
    out_avals: list[tuple[tuple[int, ...], torch.dtype]]
    kept: Sequence[int] | None
    placeholders: dict[torch.device, list[torch.Tensor]] = dataclasses.field(default_factory=dict)


def _torch_aval(index: int, aval: Any, n_exported: int) -> tuple[tuple[int, ...], torch.dtype]:
    """An exported output's shape and torch dtype; the error names the output."""
    try:
        return tuple(aval.shape), _dtypes.torch_dtype(aval.dtype)
    except TypeError as error:
        what = f"output {index}" if index < n_exported else f"saved value {index - n_exported}"
        raise TypeError(
            f"bridge_mr: on TorchTPU tensors every value a program returns or saves for the "
            f"backward pass becomes a tensor, and its {what} ({aval.dtype}, shape "
            f"{tuple(aval.shape)}) has no torch dtype: {error} A typed PRNG key in the "
            "function saves such a value: pass raw uint32 keys (jax.random.key_data) instead."
        ) from error
