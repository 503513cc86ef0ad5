"""The torch-xla backend without torch_xla: a clear ImportError (runs in both environments)."""

from __future__ import annotations

import sys

import jax
import pytest
import torch

from bridge_mr.torch_api import _xla_backend
from bridge_mr.torch_api._xla_backend import INSTALL_HINT, call_jax_on_xla


def _identity(x: jax.Array) -> tuple[jax.Array]:
    return (x,)


def test_missing_torch_xla_raises_import_error_with_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A None entry makes `import` fail as if the module were not installed; the backend keeps
    # the modules once imported, so forget them too.
    monkeypatch.setattr(_xla_backend, "_TORCH_XLA", None)
    for name in ("_internal.jax_workarounds", "core.xla_builder", "distributed.spmd", "runtime"):
        monkeypatch.setitem(sys.modules, f"torch_xla.{name}", None)
    with pytest.raises(ImportError, match="needs torch_xla") as caught:
        call_jax_on_xla(_identity, [torch.ones(2)])
    assert INSTALL_HINT in str(caught.value)
    assert INSTALL_HINT == "pip install torch==2.9.0 torch_xla==2.9.0"
