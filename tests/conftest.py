"""Test-wide configuration: 8 simulated CPU devices, strict promotion, warnings as errors.

JAX's 64-bit mode is off, as most users run JAX. `BRIDGE_MR_X64=1` turns it on before any test
(the one switch: `JAX_ENABLE_X64` is overridden). Tests marked `x64` need it; scripts/test.sh
runs them in their own leg, in each environment:

    pytest -m "not xla and not x64"                   # .venv, x64 off
    BRIDGE_MR_X64=1 pytest -m "x64 and not xla"       # .venv, x64 on
    pytest -m "xla and not x64"                       # .venv-xla, x64 off
    BRIDGE_MR_X64=1 pytest -m "xla and x64"           # .venv-xla, x64 on

An `x64`-marked test collected with x64 off is skipped, its reason naming BRIDGE_MR_X64=1. A
test that leaves the process-wide x64 or promotion setting changed fails.

On a TPU host every leg runs on JAX's CPU devices, except the TPU leg that scripts/tpu_check.sh
runs: `BRIDGE_MR_TPU=1 pytest -m tpu`, where JAX holds the chip, and the TorchTPU leg,
`BRIDGE_MR_TORCH_TPU=1 pytest -m torch_tpu`, where TorchTPU (torch_tpu) holds it and JAX stays on
the CPU. A `tpu` / `torch_tpu`-marked test is skipped elsewhere, its reason naming its command.

XLA_FLAGS (8 simulated CPU devices, nothing else: bridge_mr chooses XLA's CPU options per
program) must be set before JAX creates its CPU backend, so this runs at import time of the
conftest, which pytest loads before any test module; so does pointing bridge_mr's cache directory
(`strategy="auto"`'s decisions) at a temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def _configure_xla_flags() -> None:
    """8 simulated CPU devices (unless XLA_FLAGS sets a count)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not any(flag.split("=", 1)[0] == _DEVICE_COUNT for flag in flags.split()):
        flags = f"{flags} {_DEVICE_COUNT}=8".strip()
    os.environ["XLA_FLAGS"] = flags


def _x64_requested() -> bool:
    value = os.environ.get("BRIDGE_MR_X64", "0")
    if value not in ("0", "1"):
        raise ValueError(f"BRIDGE_MR_X64 must be 0 or 1, got {value!r}")
    return value == "1"


def _decisions_in_a_temporary_directory() -> None:
    """`strategy="auto"`'s decisions on disk go to a directory of this session, never the user's
    cache (`$BRIDGE_MR_CACHE_DIR`; child processes inherit it)."""
    os.environ["BRIDGE_MR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bridge_mr_test_cache_")


def _tpu_leg_requested() -> bool:
    value = os.environ.get("BRIDGE_MR_TPU", "0")
    if value not in ("0", "1"):
        raise ValueError(f"BRIDGE_MR_TPU must be 0 or 1, got {value!r}")
    return value == "1"


def _torch_tpu_leg_requested() -> bool:
    value = os.environ.get("BRIDGE_MR_TORCH_TPU", "0")
    if value not in ("0", "1"):
        raise ValueError(f"BRIDGE_MR_TORCH_TPU must be 0 or 1, got {value!r}")
    return value == "1"


def _chip_for_the_tpu_leg_only() -> None:
    """On a TPU host (libtpu installed), every leg but the TPU leg runs on JAX's CPU devices:
    their meshes of 8 devices are the host's simulated CPU devices, as on any other machine,
    and child processes (which inherit JAX_PLATFORMS) keep off the chip, which one process at a
    time can hold. A JAX_PLATFORMS the caller set wins."""
    if _TPU or "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


_TPU = _tpu_leg_requested()
_TORCH_TPU = _torch_tpu_leg_requested()
_TORCH_TPU_COMMAND = "BRIDGE_MR_TORCH_TPU=1 pytest -m torch_tpu (scripts/tpu_check.sh, torch_tpu)"
_TPU_COMMAND = "BRIDGE_MR_TPU=1 pytest -m tpu (scripts/tpu_check.sh on a TPU host)"
_configure_xla_flags()
_chip_for_the_tpu_leg_only()
_decisions_in_a_temporary_directory()
_X64 = _x64_requested()
_X64_COMMAND = "BRIDGE_MR_X64=1 pytest -m x64"

if _TORCH_TPU:
    import warnings

    # `import torch` loads torch_tpu, whose import reaches torch's own deprecated
    # `torch.jit.script_method` (torch 2.13); warnings are errors only from collection on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch  # noqa: F401

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", _X64)
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_report_header(config: pytest.Config) -> list[str]:
    del config  # Unused.
    import bridge_mr

    return [
        f"bridge_mr from {os.path.dirname(bridge_mr.__file__)}",
        f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}",
        f"XLA_FLAGS={os.environ['XLA_FLAGS']}",
        f"x64 {'on' if _X64 else 'off'} (BRIDGE_MR_X64={int(_X64)})",
    ]


def _has_cuda() -> bool:
    """Whether torch sees a CUDA GPU and JAX has a GPU backend."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _has_torch_tpu() -> bool:
    """Whether torch has TorchTPU's "tpu" device with a chip (`import torch` loads torch_tpu)."""
    import torch

    found = torch.accelerator.current_accelerator()
    return found is not None and found.type == "tpu" and torch.accelerator.device_count() > 0


_MISSING = {
    "xla": (
        lambda: importlib.util.find_spec("torch_xla") is None,
        "needs torch_xla: run scripts/test.sh, which tests it in .venv-xla",
    ),
    "x64": (lambda: not _X64, f"needs JAX's 64-bit mode: run {_X64_COMMAND}"),
    "cuda": (
        lambda: not _has_cuda(),
        "needs a CUDA GPU visible to torch and a JAX GPU backend (jax[cuda])",
    ),
    "tpu": (
        lambda: not (_TPU and jax.devices()[0].platform == "tpu"),
        f"needs a TPU that JAX holds: run {_TPU_COMMAND}",
    ),
    "torch_tpu": (
        lambda: not (_TORCH_TPU and _has_torch_tpu()),
        f"needs a TPU that TorchTPU holds (JAX on the CPU): run {_TORCH_TPU_COMMAND}",
    ),
}


@pytest.hookimpl(trylast=True)  # After -m deselects: a GPU is probed only for selected tests.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips tests marked for an environment this run lacks, saying how to get it.

    The one axis for environments is markers (pyproject.toml lists them): `xla` (torch_xla,
    installed in .venv-xla), `x64` (BRIDGE_MR_X64=1), `cuda` (a GPU for torch and JAX), `tpu`
    (a TPU, in the leg BRIDGE_MR_TPU=1 runs).
    """
    del config  # Unused.
    for marker, (missing, reason) in _MISSING.items():
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and missing():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _process_wide_jax_config_restored() -> Iterator[None]:
    """Fails a test that leaves x64 or the promotion mode changed for the tests after it."""
    yield
    left = (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion)
    assert left == (_X64, "strict"), f"the test left (x64, promotion) = {left}"
