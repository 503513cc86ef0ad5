"""The XLA_FLAGS bridge_mr recommends, computed without importing torch or JAX.

XLA reads XLA_FLAGS once, when JAX creates its first backend (the first `jax.devices()`, array
or jitted call), not at `import jax`; so the flags must be in `os.environ` before then.
"""

from __future__ import annotations

import importlib.util
import os
import re
from importlib import metadata

#: jaxlib 0.10's CPU YNNPACK reduce fusion makes scan-of-vmap gradients (the chunked map-reduce
#: path) much slower (jax-ml/jax#37465); `-reduce` turns that fusion off.
YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
YNN_WORKAROUND = f"{YNN_FUSION_FLAG}=-reduce"

_YNN_TOKEN = re.compile(rf"(?<!\S){re.escape(YNN_FUSION_FLAG)}(?:=\S*)?(?!\S)")


def _jaxlib_version() -> tuple[int, int] | None:
    """jaxlib's (major, minor) from its package metadata, or None if it is not installed."""
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def recommended_xla_flags(flags: str | None = None) -> str:
    """XLA_FLAGS with the workaround bridge_mr recommends for this environment added.

    Adds `--xla_cpu_experimental_ynn_fusion_type=-reduce` (jax-ml/jax#37465: on jaxlib >= 0.10
    YNNPACK's reduce fusion slows gradients of scanned, vmapped programs on CPU many times)
    where it applies:

    * jaxlib >= 0.10 only: older jaxlibs do not know the flag and abort on it.
    * Never where torch_xla is installed: torch_xla 2.9's own XLA parses XLA_FLAGS too and
      aborts on flags it does not know. There the flag is removed, even when inherited.
    * A value of the flag that `flags` already holds is kept as it is.

    Every other flag is kept, in order. Imports neither torch nor JAX, and changes nothing:
    assign the result to `os.environ["XLA_FLAGS"]` before JAX's first computation (before its
    first backend starts; after `import jax` is fine).

    Args:
      flags: the XLA_FLAGS to start from; None (default) reads `os.environ["XLA_FLAGS"]`
        (empty if unset).

    Returns:
      The flags to use, space-separated.

    Example:
      >>> import os, bridge_mr
      >>> os.environ["XLA_FLAGS"] = bridge_mr.recommended_xla_flags()
      >>> import jax  # the backend that starts later reads the recommended flags
    """
    text = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    if importlib.util.find_spec("torch_xla") is not None:
        return " ".join(_YNN_TOKEN.sub("", text).split()) if _YNN_TOKEN.search(text) else text
    version = _jaxlib_version()
    if version is None or version < (0, 10) or _YNN_TOKEN.search(text):
        return text
    return f"{text} {YNN_WORKAROUND}".strip()
