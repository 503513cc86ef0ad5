"""`bridge_mr.recommended_xla_flags`: deprecated, returns XLA_FLAGS unchanged, sets nothing."""

from __future__ import annotations

import os

import pytest

import bridge_mr


@pytest.mark.parametrize("flags", ["", "--a=1", "--xla_cpu_experimental_ynn_fusion_type=-reduce"])
def test_it_returns_the_flags_unchanged_and_says_it_is_deprecated(flags: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"cpu_compiler_options.*Remove the call"):
        assert bridge_mr.recommended_xla_flags(flags) == flags


def test_it_reads_xla_flags_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    with pytest.warns(DeprecationWarning, match="deprecated"):
        assert bridge_mr.recommended_xla_flags() == "--xla_dump_to=/tmp/x"
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
