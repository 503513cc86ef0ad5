"""The benchmark suite end to end on one tiny FedSGD row: timing, peak RSS, JSON, Markdown, PNGs.

Runs `python -m benchmarks`'s entry point in this process (torch and JAX are already imported,
which keeps the test short) with 2 repetitions; the peak-RSS measurements still run in fresh
child processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.bench import benchmark

# drjax 0.2.1 reads a mesh through an API that jax 0.10 deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)

ROOT = Path(__file__).resolve().parents[2]
ALTERNATIVES = ("bridge_mr", "drjax")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench")
    main = benchmark("__main__").main
    status = main(
        [
            "--quick",
            "--cases", "fedsgd",
            "--models", "small",
            "--clients", "4",
            "--alternatives", *ALTERNATIVES,
            "--reps", "2",
            "--memory", "all",
            "--no-xla",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert status == 0
    return out, json.loads((out / "results.json").read_text())


def test_document_header(run: tuple[Path, dict]) -> None:
    _, doc = run
    assert doc["schema"] == "bridge_mr.benchmarks/1"
    assert doc["mode"] == "quick"
    assert doc["command"].startswith("python -m benchmarks --quick --cases fedsgd")
    assert doc["duration_s"] > 0
    machine = doc["machine"]
    assert isinstance(machine["cpu_model"], str)
    assert machine["cpu_model"]
    assert machine["usable_cpus"] >= 1
    assert machine["torch"].split("+")[0].count(".") == 2
    assert machine["jax"].count(".") == 2
    assert machine["xla_flags"] == os.environ["XLA_FLAGS"]
    assert machine["jax_cpu_async_dispatch"] is True
    other = doc["load"]["other_cpus_busy"]
    assert other is None or other >= 0
    assert doc["policy"]["reps"] == 2
    assert doc["policy"]["memory"] == "all"


def test_row_timings_ratios_and_memory(run: tuple[Path, dict]) -> None:
    _, doc = run
    assert list(doc["cases"]) == ["fedsgd"]
    case = doc["cases"]["fedsgd"]
    [row] = case["rows"]
    assert row["id"] == "fedsgd/small/c4"
    assert row["params"]["clients"] == 4
    assert row["params"]["n_params"] == 9610
    assert row["baseline"] == "drjax"
    assert tuple(row["alternatives"]) == ALTERNATIVES
    for name, entry in row["alternatives"].items():
        assert "error" not in entry, (name, entry)
        assert entry["reps"] == 2
        assert entry["calls_per_rep"] >= 1
        assert 0 < entry["min_s"] <= entry["q1_s"] <= entry["median_s"]
        assert entry["median_s"] <= entry["q3_s"] <= entry["max_s"]
        assert entry["client_updates_per_s"] == pytest.approx(4 / entry["median_s"])
        ratio = entry["ratio_to_baseline"]
        assert 0 < ratio["q1"] <= ratio["median"] <= ratio["q3"]
        memory = entry["memory"]
        assert "error" not in memory, (name, memory)
        # A child forked from this process without the launcher would inherit our peak and
        # report no growth at all; building and running a round always allocates.
        assert memory["delta_rss_mb"] > 0
        assert memory["peak_rss_mb"] == pytest.approx(
            memory["import_rss_mb"] + memory["delta_rss_mb"]
        )
        assert 50 < memory["import_rss_mb"] < memory["peak_rss_mb"] < 16_000
    assert row["alternatives"]["drjax"]["ratio_to_baseline"]["median"] == 1.0


def test_targets(run: tuple[Path, dict]) -> None:
    _, doc = run
    [target] = doc["targets"]
    ratio = doc["cases"]["fedsgd"]["rows"][0]["alternatives"]["bridge_mr"]["ratio_to_baseline"]
    detail = target.pop("detail")
    assert detail.startswith("bridge_mr ")
    assert " vs drjax " in detail
    assert target == {
        "case": "fedsgd",
        "row": "fedsgd/small/c4",
        "description": "bridge_mr time / drjax time",
        "value": ratio["median"],
        "threshold": 1.10,
        "direction": "<=",
        "met": ratio["median"] <= 1.10,
    }


def test_markdown_and_plots(run: tuple[Path, dict]) -> None:
    out, _ = run
    markdown = (out / "results.md").read_text()
    assert "| fedsgd/small/c4 | drjax |" in markdown
    assert "Targets (reported, not asserted)" in markdown
    for name in ("federated.png", "ratios.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
