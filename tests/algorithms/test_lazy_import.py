"""`bridge_mr.algorithms` loads on first access, with torch and optax but not torchax."""

from __future__ import annotations

import textwrap

import pytest
from helpers.child import run_python


@pytest.mark.slow
def test_algorithms_is_a_lazy_subpackage() -> None:
    script = textwrap.dedent(
        """
        import sys
        import bridge_mr
        assert "bridge_mr.algorithms" not in sys.modules
        assert "algorithms" in dir(bridge_mr)
        alg = bridge_mr.algorithms
        assert alg is sys.modules["bridge_mr.algorithms"]
        assert {"torch", "optax"} <= set(sys.modules)
        assert not {"torchax", "apache_beam", "dp_accounting"} & set(sys.modules)
        print("ok")
        """
    )
    assert run_python(["-c", script], timeout=300).strip().endswith("ok")
