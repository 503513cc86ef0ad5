"""`bridge_mr.recommended_xla_flags`, the XLA_FLAGS helper the demo, benchmarks and tests share."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers.child import run_python

import bridge_mr

YNN = "--xla_cpu_experimental_ynn_fusion_type"
WORKAROUND = f"{YNN}=-reduce"

needs_no_torch_xla = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here"
)


def _fake_jaxlib(root: Path, version: str) -> None:
    """A jaxlib distribution's metadata (no code): importlib.metadata reports `version`."""
    info = root / f"jaxlib-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: jaxlib\nVersion: {version}\n")


@pytest.fixture
def jaxlib_0_10(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_jaxlib(tmp_path, "0.10.2")
    monkeypatch.syspath_prepend(str(tmp_path))


@needs_no_torch_xla
@pytest.mark.usefixtures("jaxlib_0_10")
def test_adds_the_workaround_after_the_other_flags() -> None:
    assert bridge_mr.recommended_xla_flags("") == WORKAROUND
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false"
    assert bridge_mr.recommended_xla_flags(flags) == f"{flags} {WORKAROUND}"
    # A flag whose name merely starts like it is another flag.
    other = f"{YNN}_other=1"
    assert bridge_mr.recommended_xla_flags(other) == f"{other} {WORKAROUND}"


@needs_no_torch_xla
@pytest.mark.usefixtures("jaxlib_0_10")
@pytest.mark.parametrize("flags", [f"--a=1  {YNN}=+all --b", YNN, WORKAROUND])
def test_keeps_a_value_the_caller_set_and_everything_else(flags: str) -> None:
    assert bridge_mr.recommended_xla_flags(flags) == flags


@needs_no_torch_xla
@pytest.mark.usefixtures("jaxlib_0_10")
def test_reads_the_environment_by_default_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert bridge_mr.recommended_xla_flags() == f"--xla_dump_to=/tmp/x {WORKAROUND}"
    assert bridge_mr.recommended_xla_flags(None) == bridge_mr.recommended_xla_flags()
    monkeypatch.delenv("XLA_FLAGS")
    assert bridge_mr.recommended_xla_flags() == WORKAROUND
    flags = bridge_mr.recommended_xla_flags("--a=1")
    assert bridge_mr.recommended_xla_flags(flags) == flags  # Idempotent.


@needs_no_torch_xla
def test_older_jaxlibs_get_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """jaxlib < 0.10 aborts on a flag it does not know."""
    _fake_jaxlib(tmp_path, "0.9.2")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bridge_mr.recommended_xla_flags("--a=1") == "--a=1"


@pytest.mark.usefixtures("jaxlib_0_10")
def test_never_with_torch_xla_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla 2.9's XLA aborts on the flag: removed, even when inherited."""
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bridge_mr.recommended_xla_flags("") == ""
    assert bridge_mr.recommended_xla_flags("--a=1") == "--a=1"
    assert bridge_mr.recommended_xla_flags(f"--a=1  {WORKAROUND} --b=2") == "--a=1 --b=2"
    assert bridge_mr.recommended_xla_flags(f"{YNN}=+all") == ""


def test_the_helper_imports_neither_torch_nor_jax() -> None:
    """Its module alone, in a fresh interpreter: it must be usable before either is imported."""
    path = Path(bridge_mr.__file__).with_name("_flags.py")
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('flags', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.recommended_xla_flags('')\n"
        "print(json.dumps(sorted({'torch', 'jax', 'jaxlib'} & set(sys.modules))))\n"
    )
    assert json.loads(run_python(["-c", script], timeout=60)) == []
