"""The overhead case's own-share target: the bridge's time above floor + pure JAX in one call,
paired per repetition, against the accelerator issue's threshold for the device."""

from __future__ import annotations

import pytest
from helpers.bench import benchmark

harness = benchmark("harness")
report = benchmark("report")
overhead = benchmark("cases.overhead")

BRIDGE, TOGETHER, JAX = "bridge map_reduce", "floor + pure JAX in one call", "pure JAX"


def _comparison(bridge: list[float], together: list[float]) -> harness.Comparison:
    timings = {
        BRIDGE: harness.Timing(samples=bridge, number=1),
        TOGETHER: harness.Timing(samples=together, number=1),
        JAX: harness.Timing(samples=[1e-5] * len(bridge), number=1),
    }
    return harness.Comparison(JAX, timings)


def _row(comparison: harness.Comparison) -> dict:
    return report.comparison_row(comparison, "map_reduce fedsgd tiny", {"device": "cpu"})


def test_the_difference_is_paired_per_repetition() -> None:
    # A drift that slows both sides alike in a repetition cancels: each pair differs by 30 us,
    # while the difference of the medians (250 - 200) would say 50.
    comparison = _comparison([230e-6, 250e-6, 330e-6], [200e-6, 220e-6, 300e-6])
    difference = comparison.difference(BRIDGE, TOGETHER)
    assert difference is not None
    assert difference["median"] == pytest.approx(30e-6)
    assert comparison.difference(BRIDGE, "missing") is None


@pytest.mark.parametrize(("device", "met"), [("cpu", False), ("cuda", True)])
def test_the_own_share_target_uses_the_devices_threshold(device: str, met: bool) -> None:
    comparison = _comparison([250e-6, 260e-6, 255e-6], [200e-6, 200e-6, 200e-6])
    target = overhead.own_share_target(comparison, _row(comparison), BRIDGE, device)
    assert target["value"] == pytest.approx(55.0)
    assert target["threshold"] == {"cpu": 40.0, "cuda": 150.0}[device]
    assert target["met"] is met
    assert "own share" in target["description"]
    assert TOGETHER in target["detail"]


def test_an_untimed_side_leaves_the_target_unmeasured() -> None:
    comparison = _comparison([250e-6], [200e-6])
    comparison.timings[TOGETHER] = harness.Timing(error="RuntimeError: no")
    target = overhead.own_share_target(comparison, _row(comparison), BRIDGE, "cpu")
    assert target["value"] is None
    assert target["met"] is None


def test_the_tiny_map_reduce_row_alone_carries_the_own_share_target() -> None:
    assert [row.row_id for row in overhead.ROWS if row.own_share] == ["map_reduce fedsgd tiny"]


def test_the_note_gives_the_own_share_as_the_target_does() -> None:
    # Paired differences 30, 10 and 30 us (median 30); the medians differ by 250 - 240 = 10.
    comparison = _comparison([230e-6, 250e-6, 330e-6], [200e-6, 240e-6, 300e-6])
    comparison.timings["torch autograd floor"] = harness.Timing(samples=[7e-5] * 3, number=1)
    row = _row(comparison)
    note = overhead._lower_bound(comparison, row, BRIDGE, JAX)
    target = overhead.own_share_target(comparison, row, BRIDGE, "cpu")
    assert target["value"] == pytest.approx(30.0)
    assert note is not None
    assert "30.0 µs above the two in one call" in note, note
