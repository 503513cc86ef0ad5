"""Runs programs on TorchTPU tensors (torch device "tpu"): the round stays on the chip.

In a process where TorchTPU (`torch_tpu`) holds the chip, JAX only traces and exports:
each program is exported once per signature for the TPU (`jax.export`, StableHLO) and run by
TorchTPU on the "tpu" tensors themselves (`bridge_mr._compat.torch_tpu`), with its results new
"tpu" tensors. No DLPack and no host round trip; carried values (a VJP's residuals) are "tpu"
tensors too. JAX must stay off the chip there (`JAX_PLATFORMS=cpu`): one process at a time
can hold it, and TorchTPU does.

64-bit integers while `jax_enable_x64` is off: as on torch-xla, an int64 / uint64 tensor given
for an int32 / uint32 input is cast on the device after a check of its values (one device read
per call for all such tensors together). Cast labels to int32 yourself to avoid it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.export
import torch

from bridge_mr import _dtypes, jax_core
from bridge_mr._compat import torch_tpu as torch_tpu_compat
from bridge_mr._dtypes import Aval

from ._narrowing import narrow, narrowable
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
        with trace_context():  # As traced (JAX's trace cache then serves the export); checks JAX.
            exported = jax.export.export(jitted, platforms=("tpu",))(  # type: ignore[arg-type]
                *(jax.ShapeDtypeStruct(*aval) for aval in in_avals)
            )
        self._kernels = torch_tpu_compat.kernels()
        self._out_avals = [_torch_aval(i, a, n_exported) for i, a in enumerate(exported.out_avals)]
        serialized = exported.mlir_module_serialized
        # Kernels are TorchTPU's by (name, fingerprint): the same program is registered (and
        # compiled) once, whichever runner exports it.
        self._fingerprint = hashlib.blake2b(serialized, digest_size=16).hexdigest()
        if not self._kernels.lookup(_NAME, self._fingerprint):
            self._kernels.register(_NAME, self._fingerprint, serialized_mlir_module=serialized)
        # The inputs the exported module takes: jax.jit drops those the program never reads
        # (their int64 values then need no check either).
        kept = exported.module_kept_var_idx
        self._kept = None if len(kept) == len(in_avals) else kept
        self._n_exported = n_exported
        self._narrowable = tuple(i for i in narrowable(in_avals) if i in kept)
        self._names = names
        # Shapes and dtypes of the results, which TorchTPU allocates itself; kept per device as
        # torch_tpu's own `jax_op` keeps them per signature.
        self._placeholders: dict[torch.device, list[torch.Tensor]] = {}

    def __call__(
        self, tensors: Sequence[torch.Tensor], carried: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[Any]]:
        inputs = narrow([*tensors, *carried], self._narrowable, self._names)
        device = inputs[0].device
        if self._kept is not None:
            inputs = [inputs[i] for i in self._kept]
        placeholders = self._placeholders.get(device)
        if placeholders is None:
            placeholders = [torch.empty(s, dtype=d, device=device) for s, d in self._out_avals]
            self._placeholders[device] = placeholders
        # Around every call, not only the first (which compiles): the options may key
        # TorchTPU's executables.
        self._kernels.push_options(COMPILER_OPTIONS)
        try:
            outputs = list(
                self._kernels.call(
                    _NAME,
                    self._fingerprint,
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
