"""The torch-xla runner without torch_xla: a clear ImportError (runs in both environments)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["torch_xla"] = None  # Imports of torch_xla and its submodules fail as if absent.
    import torch
    from bridge_mr.runners import call_jax_on_xla
    try:
        call_jax_on_xla(lambda x: (x,), [torch.ones(2)])
    except ImportError as error:
        print(json.dumps(str(error)))
    else:
        print(json.dumps("no ImportError was raised"))
    """
)


def test_missing_torch_xla_raises_import_error_with_install_line(
    run_child: Callable[[str], Any],
) -> None:
    message = run_child(_SCRIPT)
    assert "needs torch_xla" in message
    assert "pip install torch==2.9.0 torch_xla==2.9.0" in message
