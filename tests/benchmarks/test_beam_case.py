"""The "beam" benchmark case end to end on a tiny configuration (timing, JSON, Markdown)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.bench import benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_beam_case_reports_beam_and_jit_rows_of_both_models(tmp_path):
    main = benchmark("__main__").main
    status = main(
        ["--quick", "--cases", "beam", "--clients", "4", "9", "--memory", "none", "--no-xla",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert status == 0
    case = json.loads((tmp_path / "results.json").read_text())["cases"]["beam"]
    ids = [row["id"] for row in case["rows"]]
    assert ids == ["beam/c4", "beam/c9", "beam-cnn/c4 first call", "beam-cnn/c4", "beam-cnn/c9"]
    for row in case["rows"]:
        names = {"jit", "beam FnApiRunner", "beam DaskRunner (2 workers)"}
        assert set(row["alternatives"]) == names
        for name in names - {"jit"}:
            beam = row["alternatives"][name]
            assert beam["median_s"] > 0
            assert beam["ratio_to_baseline"]["median"] > 0
        if not row["id"].endswith("first call"):
            assert len(row["load_1min"]) >= 3  # One per interleaved round.
    assert case["rows"][2]["params"]["model"] == "cnn"
    # Lines: the linear model's Beam runners; the CNN's jit and Beam runners.
    assert sum("per client" in note for note in case["notes"]) == 5
    assert sum(note.startswith("CNN, ") and "per client" in note for note in case["notes"]) == 3
    markdown = (tmp_path / "results.md").read_text()
    assert "beam/c9" in markdown
    assert "beam-cnn/c4 first call" in markdown
