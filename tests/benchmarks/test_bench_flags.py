"""`python -m benchmarks.studies.bench_flags` on one small row: each setting compiles, runs, is
reported."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.bench import benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_bench_flags_times_each_setting_of_a_row(capsys):
    bench_flags = benchmark("studies.bench_flags")
    status = bench_flags.main(
        ["--rows", "small fedsgd c64 vmap", "--settings", "none", "dot", "--reps", "2"]
    )
    assert status == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| small fedsgd c64 vmap |")]
    assert len(table) == 1, out
    assert table[0].count(" ms") == 3, out
    results = json.loads(out.strip().splitlines()[-1])["results"]["small fedsgd c64 vmap"]
    assert set(results) == {"default", "none", "dot"}
    assert all(r["median_s"] > 0 for r in results.values())
    assert all(r["ratio"]["median"] > 0 for name, r in results.items() if name != "default")
