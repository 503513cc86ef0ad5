"""Test-wide configuration: 8 simulated CPU devices, x64, strict promotion, warnings as errors.

XLA_FLAGS must be set before JAX creates its CPU backend, so this runs at import time of the
conftest, which pytest loads before any test module.
"""

from __future__ import annotations

import importlib.util
import os

_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(part) for part in version("jaxlib").split(".")[:2])


def _append_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    wanted = {"--xla_force_host_platform_device_count": "8"}
    if importlib.util.find_spec("torch_xla") is not None:
        # torch_xla 2.9's own XLA aborts the process on this flag, which it does not know.
        flags = [flag for flag in flags if flag.split("=", 1)[0] != _YNN_FLAG]
    elif _jaxlib_version() >= (0, 10):
        # jaxlib 0.10 CPU: YNNPACK reduce fusion slows scan-of-vmap gradients (jax#37465).
        # Older jaxlibs do not know the flag and abort on it.
        wanted[_YNN_FLAG] = "-reduce"
    present = {flag.split("=", 1)[0] for flag in flags}
    flags += [f"{name}={value}" for name, value in wanted.items() if name not in present]
    os.environ["XLA_FLAGS"] = " ".join(flags)


_append_xla_flags()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_report_header(config: pytest.Config) -> list[str]:
    del config  # Unused.
    import bridge_mr

    return [
        f"bridge_mr from {os.path.dirname(bridge_mr.__file__)}",
        f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}",
        f"XLA_FLAGS={os.environ['XLA_FLAGS']}",
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips `xla`-marked tests where torch_xla is missing (scripts/test.sh runs them)."""
    del config  # Unused.
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(
        reason="needs torch_xla: run scripts/test.sh, which tests it in .venv-xla"
    )
    for item in items:
        if item.get_closest_marker("xla") is not None:
            item.add_marker(skip)
