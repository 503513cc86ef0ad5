"""`recommended_xla_flags`, kept for old callers: bridge_mr no longer recommends a process flag.

bridge_mr used to recommend `--xla_cpu_experimental_ynn_fusion_type=-reduce` in XLA_FLAGS (a
jaxlib 0.10 CPU slowdown, jax-ml/jax#37465). A process-wide flag covers every program of the
process, the user's too, and made transformer rounds 2.6x slower; bridge_mr now chooses that
option per program when it compiles one (`bridge_mr.jax_core.cpu_compiler_options`), so there
is nothing to set. Imports neither torch nor JAX.
"""

from __future__ import annotations

import os
import warnings


def recommended_xla_flags(flags: str | None = None) -> str:
    """Deprecated: XLA_FLAGS as given; bridge_mr needs no process-wide XLA flag any more.

    bridge_mr compiles each of its CPU programs with the XLA options that program runs best
    with (`bridge_mr.jax_core.cpu_compiler_options`), so setting a flag for the whole process
    (which would reach your own programs too) is no longer recommended. Returns `flags` (or
    `os.environ["XLA_FLAGS"]`) unchanged and warns; it will be removed.

    Args:
      flags: XLA_FLAGS; None (default) reads `os.environ["XLA_FLAGS"]` (empty if unset).

    Returns:
      The flags, unchanged.

    Example:
      >>> import warnings, bridge_mr
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore", DeprecationWarning)
      ...     bridge_mr.recommended_xla_flags("--xla_dump_to=/tmp/x")
      '--xla_dump_to=/tmp/x'
    """
    warnings.warn(
        "bridge_mr.recommended_xla_flags() is deprecated and returns XLA_FLAGS unchanged: "
        "bridge_mr chooses XLA's CPU options per program (bridge_mr.jax_core."
        "cpu_compiler_options), so no process-wide flag is needed. Remove the call.",
        DeprecationWarning,
        stacklevel=2,
    )
    return os.environ.get("XLA_FLAGS", "") if flags is None else flags
