"""The "accelerator" case (issues 31, 41) on the CPU: `--device` and the case's options parse,
`--device tpu` refuses without a TPU, the GPU and TPU peak tables answer by device name, and a
tiny run writes rows with the first round, the later rounds' median, peak memory, FLOPs and the
fraction of the device's peak, every alternative in its own process.

Only whether the case runs and reports is checked here; its times are benchmark rows. The CUDA
path (`--device cuda`) runs in scripts/gpu_check.sh on a GPU machine, the TPU path
(`--device tpu`) in scripts/tpu_bench.sh on a TPU host.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers.bench import benchmark


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.accelerator")


@pytest.fixture(scope="module")
def rows() -> ModuleType:
    return benchmark("workloads.accelerator")


def test_device_is_an_option_and_the_case_is_opt_in() -> None:
    main = benchmark("__main__")
    default = main._parse([])
    assert default.device == "cpu"
    assert "accelerator" not in default.cases
    assert "users_path" in default.cases
    asked = main._parse(["--cases", "accelerator", "--device", "cuda", "--reps", "2"])
    assert (asked.cases, asked.device, asked.reps) == (["accelerator"], "cuda", 2)
    tpu = main._parse(
        ["--cases", "accelerator", "--device", "tpu", "--precision", "highest", "medium"]
    )
    assert (tpu.device, tpu.precision) == ("tpu", ["highest", "medium"])
    with pytest.raises(SystemExit):
        main._parse(["--device", "gpu"])
    with pytest.raises(SystemExit):
        main._parse(["--precision", "low"])


def test_device_tpu_without_a_tpu_says_what_is_missing_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    main = benchmark("__main__").main
    status = main(["--cases", "accelerator", "--device", "tpu", "--out", str(tmp_path)])
    assert status == 2
    err = capsys.readouterr().err
    assert "--device tpu: JAX's default backend is 'cpu', not a TPU" in err
    assert "Fix:" in err
    assert main(["--cases", "overhead", "--device", "tpu", "--out", str(tmp_path)]) == 2
    assert "runs the accelerator case only" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # Nothing ran.


def test_a_tpu_row_keeps_torch_on_the_host_and_names_its_precision(rows: ModuleType) -> None:
    highest = rows.AcceleratorConfig("cnn", 50, device="tpu")
    medium = rows.AcceleratorConfig("cnn", 50, device="tpu", precision="medium")
    assert (highest.tensor_device, highest.row_id) == ("cpu", "accelerator/cnn/c50")
    assert medium.row_id == "accelerator/cnn/c50/medium"
    assert rows.AcceleratorConfig("cnn", 50, device="cuda").tensor_device == "cuda"


def test_torch_tpu_alternatives_keep_jax_off_the_chip(case: ModuleType, rows: ModuleType) -> None:
    """TorchTPU's alternatives put their tensors on "tpu" and run with JAX on the CPU (TorchTPU
    holds the chip); the others are left as they were."""
    for name in ("torch_loop_torchtpu", "bridge_mr_torchtpu", "bridge_mr_torchtpu:per_client"):
        assert rows.on_torch_tpu(name)
        assert case._env("tpu", name)["JAX_PLATFORMS"] == "cpu"
    for name in ("torch_loop", "bridge_mr", "bridge_mr_resident", "pure_jax"):
        assert not rows.on_torch_tpu(name)
    # bridge_mr with host tensors runs JAX on the chip: its environment is the caller's.
    assert case._env("tpu", "bridge_mr").get("JAX_PLATFORMS") == os.environ.get("JAX_PLATFORMS")


def test_tpu_peaks_by_kind(rows: ModuleType) -> None:
    v5e = rows.tpu_peak("TPU v5 lite")  # JAX's device_kind of a v5e
    assert v5e["peak_flop_per_s"] == pytest.approx(197e12)
    assert "datasheet" in v5e["source"] or "documentation" in v5e["source"]
    unknown = rows.tpu_peak("TPU v9")
    assert "peak_flop_per_s" not in unknown
    assert "no datasheet peak" in unknown["source"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_device_cuda_without_cuda_says_what_is_missing_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    main = benchmark("__main__").main
    status = main(["--cases", "overhead", "--device", "cuda", "--out", str(tmp_path)])
    assert status == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch" in err
    assert "sees no CUDA device" in err
    assert "Fix:" in err
    assert not list(tmp_path.iterdir())  # Nothing ran.


def test_gpu_peaks_by_name(rows: ModuleType) -> None:
    h200 = rows.gpu_peak("NVIDIA H200")
    assert h200["peak_flop_per_s"] == pytest.approx(494.7e12)
    assert h200["fp32_flop_per_s"] == pytest.approx(66.9e12)
    assert "datasheet" in h200["source"]
    assert rows.gpu_peak("NVIDIA H200 NVL")["peak_flop_per_s"] < h200["peak_flop_per_s"]
    unknown = rows.gpu_peak("Some GPU")
    assert "peak_flop_per_s" not in unknown
    assert "no datasheet peak" in unknown["source"]


def test_flops_are_counted_per_client_and_step(rows: ModuleType) -> None:
    one = rows.flops(rows.AcceleratorConfig("cnn", 1, steps=1, batch=2))
    assert 1.5e8 < one < 2.5e8  # ~100 MFLOP per training image (issue 31)
    assert rows.flops(rows.AcceleratorConfig("cnn", 3, steps=2, batch=2)) == pytest.approx(6 * one)


def test_a_tiny_cpu_run_reports_every_field(case: ModuleType, rows: ModuleType) -> None:
    harness = benchmark("harness")
    ctx = harness.Context(
        quick=True,
        policy=harness.QUICK,
        alternatives=(),
        round_alternatives=("torch_loop", "bridge_mr:vmap"),
    )
    configs = [
        rows.AcceleratorConfig("tiny", 2, steps=1, batch=4),
        rows.AcceleratorConfig("cnn", 2, steps=1, batch=2),
    ]
    result = case.run(ctx, configs=configs, rounds=1)
    ids = [row["id"] for row in result.rows]
    assert ids == [
        "accelerator/tiny/c2",
        "accelerator/tiny/c2 first round",
        "accelerator/cnn/c2",
        "accelerator/cnn/c2 first round",
    ]
    for row in result.rows[::2]:
        params = row["params"]
        assert params["flops_per_round"] > 0
        assert params["peak_flop_per_s"] > 0
        assert "measured" in params["peak_source"]
        assert list(row["alternatives"]) == ["torch_loop", "bridge_mr:vmap"]
        for name, entry in row["alternatives"].items():
            assert "error" not in entry, (row["id"], name, entry)
            assert entry["first_round_s"] > 0
            assert entry["median_s"] > 0
            assert entry["achieved_flop_per_s"] == pytest.approx(
                params["flops_per_round"] / entry["median_s"]
            )
            assert 0 < entry["fraction_of_peak"] < 10
            assert entry["memory"]["peak_rss_mb"] > entry["memory"]["import_rss_mb"] > 0
            assert "device_peak_mb" not in entry["memory"]  # CPU: RSS only
        assert params["max_abs_difference_after_first_round"]["bridge_mr:vmap"] < 1e-4
    for first in result.rows[1::2]:
        assert all(e["median_s"] > 0 for e in first["alternatives"].values())
    report = benchmark("report")
    assert "% of peak" in report.case_markdown(result)


def test_a_worker_can_start_jax_before_the_first_round_and_time_it_apart(tmp_path: Path) -> None:
    """`"start_backend": true`: the "ready" event's `backend_s` is JAX's runtime start, out of
    `first_s` (the compile cache's rows on the chip, scripts/tpu_bench.sh `cache`)."""
    import json
    import subprocess
    import sys

    from helpers.bench import ROOT

    config = {"model": "tiny", "clients": 2, "steps": 1, "batch": 4, "device": "cpu"}
    spec = {"workload": "accelerator", "alternative": "bridge_mr", "start_backend": True,
            "save": str(tmp_path / "params.npz"), "config": config}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.workers.users", json.dumps(spec)],
        input="quit\n", capture_output=True, text=True, cwd=ROOT, timeout=300, check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ready = next(e for e in events if e["event"] == "ready")
    assert ready["backend_s"] > 0
    assert ready["first_s"] > 0
