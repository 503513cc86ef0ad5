"""torchax is imported on a converted function's first call, version-checked, with a clear fix."""

from __future__ import annotations

import json
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


_STATE = textwrap.dedent(
    """
    import json, os, sys
    import jax, torch, torch._decomp


    def state():
        return {
            "accelerator": str(torch.accelerator.current_accelerator()),
            "available": torch.accelerator.is_available(),
            "privateuse1": torch._C._get_privateuse1_backend_name(),
            "device modules": sorted(m for m in sys.modules if m.startswith("torch.jax")),
            "torch.jax": hasattr(torch, "jax"),
            "mha fast path": torch.backends.mha.get_fastpath_enabled(),
            "telemetry": os.environ.get("ENABLE_RUNTIME_UPTIME_TELEMETRY"),
            "client options": getattr(jax.config, "jax_pjrt_client_create_options", None),
            "decompositions": {
                kind: sorted(map(str, table))
                for kind, table in torch._decomp.global_decomposition_table.items()
            },
        }
    """
)


def test_from_torch_leaves_torch_and_jax_as_it_found_them() -> None:
    # Import, conversion, trace and call, forward and backward through map_reduce: torch's and
    # JAX's process-wide state afterwards is what it was before bridge_mr was imported.
    script = _STATE + textwrap.dedent(
        """
        before = state()
        import jax.numpy as jnp
        import bridge_mr

        def loss(w, batch):
            x, y = batch
            hidden = torch.nn.functional.gelu(x @ w + torch.ones(w.shape[1], device=x.device))
            return ((hidden.sum(-1) - y) ** 2).mean()

        converted = bridge_mr.from_torch(loss)
        jax.make_jaxpr(converted)(jnp.ones((3, 2)), (jnp.ones((4, 3)), jnp.ones(4)))
        w = torch.randn(3, 2, requires_grad=True)
        data = (torch.randn(5, 4, 3), torch.randn(5, 4))
        bridge_mr.map_reduce(converted, w, data).backward()
        assert w.grad is not None and bool(torch.isfinite(w.grad).all())
        after = state()
        print(json.dumps({"same": after == before, "before": before, "after": after}))
        """
    )
    result = json.loads(run_python(["-c", script]))
    changed = {k: (result["before"][k], v) for k, v in result["after"].items()}
    changed = {k: v for k, v in changed.items() if v[0] != v[1]}
    assert result["same"], f"changed (before, after): {changed}"


def test_torch_compile_with_inductor_works_after_from_torch_ran() -> None:
    # pytorch/xla issue 9730: with torchax's registration, inductor asks the "jax" accelerator
    # for a device and fails on a function without tensor inputs.
    script = textwrap.dedent(
        """
        import jax.numpy as jnp, torch, bridge_mr

        bridge_mr.from_torch(lambda x: x * 2)(jnp.ones(2))  # imports torchax
        print(torch.compile(lambda: torch.ones(2) * 3, backend="inductor")().tolist())
        double = bridge_mr.torch_function(lambda x: 2 * x, compilable=True)
        compiled = torch.compile(lambda x: double(x) + 1, fullgraph=True, backend="eager")
        print(compiled(torch.ones(2)).tolist())
        """
    )
    assert run_python(["-c", script]).split() == ["[3.0,", "3.0]", "[3.0,", "3.0]"]


def test_a_torchax_the_user_imported_first_keeps_its_registration() -> None:
    # The user asked for torchax's registration: bridge_mr undoes nothing, and its converted
    # functions still run (factories given the argument's device make torchax tensors).
    script = textwrap.dedent(
        """
        import jax.numpy as jnp, torch, torchax, bridge_mr

        def f(x):
            return (x + torch.arange(2, device=x.device) + torch.ones(2)).sum()

        out = bridge_mr.from_torch(f)(jnp.ones(2))
        print(float(out), torch._C._get_privateuse1_backend_name(), torch.jax.is_available())
        """
    )
    assert run_python(["-c", script]).split() == ["5.0", "jax", "True"]
