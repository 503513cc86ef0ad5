"""torchax is imported on a converted function's first call, version-checked, with a clear fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers.child import run_python

_CALL = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import bridge_mr

    fn = bridge_mr.from_torch(lambda x: x * 2)
    assert "torchax" not in sys.modules, "from_torch imported torchax before its first call"
    try:
        fn(jnp.ones(2))
    except ImportError as error:
        print("IMPORT ERROR:", error)
    else:
        print("RAN", "torchax" in sys.modules)
    """
)


def test_torchax_loads_on_the_first_call_only() -> None:
    assert run_python(["-c", _CALL]).strip() == "RAN True"


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        ("", "not importable"),  # an empty directory shadowing nothing: torchax is missing
        ('__version__ = "0.0.13"\n', "torchax 0.0.13 is installed"),
    ],
)
def test_a_missing_or_other_torchax_is_an_import_error_with_the_install_command(
    tmp_path: Path, package: str, expected: str
) -> None:
    if package:
        (tmp_path / "torchax").mkdir()
        (tmp_path / "torchax" / "__init__.py").write_text(package)
        (tmp_path / "torchax" / "tensor.py").write_text(
            "Environment = Tensor = OperatorNotFound = 0\n"
        )
        (tmp_path / "torchax" / "view.py").write_text("View = 0\n")
        script = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _CALL
    else:
        # Hides the installed torchax: a meta path finder that refuses the name.
        script = (
            "import sys\n"
            "class _Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torchax' or name.startswith('torchax.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, _Hide())\n" + _CALL
        )
    out = run_python(["-c", script])
    assert out.startswith("IMPORT ERROR:"), out
    assert expected in out
    assert "pip install torchax==0.0.14.dev20261026" in out


def test_torch_compile_still_works_after_from_torch_ran() -> None:
    script = textwrap.dedent(
        """
        import jax.numpy as jnp, torch, bridge_mr

        had_accelerator = torch.accelerator.is_available()
        bridge_mr.from_torch(lambda x: x * 2)(jnp.ones(2))  # imports torchax
        assert torch.accelerator.is_available() == had_accelerator
        double = bridge_mr.torch_function(lambda x: 2 * x, compilable=True)
        compiled = torch.compile(lambda x: double(x) + 1, fullgraph=True, backend="eager")
        print(compiled(torch.ones(2)).tolist())
        """
    )
    assert run_python(["-c", script]).strip() == "[3.0, 3.0]"
