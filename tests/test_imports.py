"""The top level is lazy: plain-JAX use of bridge_mr never imports torch (fresh interpreters)."""

from __future__ import annotations

import textwrap

from helpers.child import run_python

_PLAIN_JAX_PROGRAM = """
    import jax, jax.numpy as jnp

    @jax.jit
    @bridge_mr.program(placements={"clients": 3})
    def round_(params, data):
        placed = bridge_mr.broadcast(params)
        losses = bridge_mr.map_fn(lambda p, d: jnp.sum((d @ p) ** 2), (placed, data))
        weights = bridge_mr.map_fn(lambda d: jnp.float32(d.shape[0]), data)
        total = bridge_mr.reduce_sum(losses)
        return bridge_mr.reduce_mean(losses), bridge_mr.reduce_weighted_mean(losses, weights), total

    mean, weighted, total = round_(jnp.ones((4, 2)), jnp.ones((3, 5, 4)))
    assert [round(float(v), 3) for v in (mean, weighted, total)] == [160.0, 160.0, 480.0]
    assert jax.grad(lambda p: round_(p, jnp.ones((3, 5, 4)))[0])(jnp.ones((4, 2))).shape == (4, 2)
"""


def _run(*blocks: str) -> None:
    """Runs the code `blocks` (each dedented) in one fresh interpreter, JAX on the CPU."""
    code = "\n".join(textwrap.dedent(block) for block in blocks)
    run_python(["-c", code], env={"JAX_PLATFORMS": "cpu"}, timeout=300)


def test_import_bridge_mr_and_a_plain_jax_program_leave_torch_out():
    _run(
        "import sys\nimport bridge_mr",
        _PLAIN_JAX_PROGRAM,
        """
        bridge_mr.clear_caches()
        assert "torch" not in sys.modules, "torch was imported"
        """,
    )


def test_import_jax_core_alone_leaves_torch_out():
    _run(
        """
        import sys
        import bridge_mr.jax_core
        assert "torch" not in sys.modules, "torch was imported"
        """
    )


def test_a_torch_name_loads_torch_on_first_access():
    _run(
        """
        import sys
        import bridge_mr
        assert "torch" not in sys.modules
        bridge_mr.map_reduce
        assert "torch" in sys.modules
        """
    )


def test_the_lazy_names_are_the_torch_api_and_dlpack_ones():
    _run(
        """
        import sys
        import bridge_mr
        for module in ("dlpack", "torch_api"):
            assert getattr(bridge_mr, module) is sys.modules[f"bridge_mr.{module}"], module
        for name in ("map_reduce", "torch_function", "TorchFunction", "RetraceWarning",
                     "trace_counts"):
            assert getattr(bridge_mr, name) is getattr(bridge_mr.torch_api, name), name
        """
    )


def test_the_mapreduce_names_run_the_torch_frontend_once_torch_is_imported():
    _run(
        """
        import torch
        import bridge_mr
        with bridge_mr.program(clients=3):
            out = bridge_mr.reduce_mean(bridge_mr.broadcast(torch.ones(2, requires_grad=True)))
        assert isinstance(out, torch.Tensor) and out.requires_grad
        assert bridge_mr.trace_counts()["reduce_mean"] >= 1
        """,
        _PLAIN_JAX_PROGRAM,
    )


def test_star_import_and_dir_list_every_public_name():
    _run(
        """
        import bridge_mr
        listed = set(dir(bridge_mr))
        namespace = {}
        exec("from bridge_mr import *", namespace)
        missing = set(bridge_mr.__all__) - set(namespace)
        assert not missing, missing
        assert set(bridge_mr.__all__) | {"torch_api"} <= listed, listed
        assert {"map_reduce", "clear_caches", "recommended_xla_flags"} <= set(bridge_mr.__all__)
        """
    )


def test_unknown_attribute_raises_attribute_error():
    _run(
        """
        import bridge_mr
        try:
            bridge_mr.no_such_name
        except AttributeError as err:
            assert "no attribute 'no_such_name'" in str(err)
        else:
            raise AssertionError("no AttributeError")
        """
    )


def test_without_torch_plain_jax_runs_and_torch_names_say_how_to_install_it():
    # As in an environment without torch (scripts/test.sh also runs this in .venv-notorch).
    _run(
        """
        import sys
        sys.modules["torch"] = None  # `import torch` now raises ModuleNotFoundError
        import bridge_mr
        """,
        _PLAIN_JAX_PROGRAM,
        """
        for name in ("map_reduce", "from_torch", "torch_api", "algorithms", "dlpack"):
            try:
                getattr(bridge_mr, name)
            except ModuleNotFoundError as err:
                assert err.name == "torch", err.name
                assert f"bridge_mr.{name} needs PyTorch" in str(err), str(err)
                assert 'pip install "bridge_mr[torch]"' in str(err), str(err)
            else:
                raise AssertionError(f"bridge_mr.{name} loaded without torch")
        """,
    )


def test_the_installed_package_requires_torch_only_through_its_extras():
    from importlib import metadata

    torch = [r for r in metadata.requires("bridge_mr") or [] if r.split(">")[0].strip() == "torch"]
    assert torch, "no extra lists torch"
    assert all("extra ==" in r for r in torch), torch
    assert any('extra == "torch"' in r for r in torch), torch
