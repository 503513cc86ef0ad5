"""The "users_path" case: the documented round (docs/algorithms.md) and what a torch user writes
instead compute the same first round, each alternative in its own process, and the case reports
rows and targets.

Only whether the case runs and agrees is checked here; its times are benchmark rows.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest
from helpers.bench import benchmark

# torch.func.vmap of GPT-2's sdpa attention runs torch's per-example fallback, and says so.
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
)


@pytest.fixture(scope="module")
def case() -> ModuleType:
    return benchmark("cases.users_path")


@pytest.fixture(scope="module")
def users(case: ModuleType) -> ModuleType:
    return benchmark("workloads.users")


def _quick_ctx(alternatives: tuple[str, ...] | None = None) -> object:
    harness = benchmark("harness")
    return harness.Context(
        quick=True, policy=harness.QUICK, alternatives=(), round_alternatives=alternatives
    )


@pytest.mark.parametrize("model", ["cnn", "gpt2", "resnet18"])
def test_the_torch_rounds_agree_in_process(users: ModuleType, model: str) -> None:
    cfg = users.UserConfig(model, 2, steps=2, batch=4)
    initial = [p.detach().numpy().copy() for p in users.build_model(model).parameters()]
    loop = [p.detach().numpy().copy() for p in users.build("torch_loop", cfg)()]
    vmapped = [p.detach().numpy() for p in users.build("torch_vmap", cfg)()]
    assert max(float(np.abs(a - b).max()) for a, b in zip(loop, initial, strict=True)) > 1e-4
    for a, b in zip(vmapped, loop, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_data_is_seeded_and_shaped_per_client_and_step(users: ModuleType) -> None:
    cnn = users.data(users.UserConfig("cnn", 3, steps=2, batch=4))
    assert cnn["x"].shape == (3, 2, 4, 3, 32, 32)
    assert cnn["y"].dtype == np.int64
    again = users.data(users.UserConfig("cnn", 3, steps=2, batch=4))
    np.testing.assert_array_equal(cnn["x"], again["x"])
    assert users.data(users.UserConfig("gpt2", 3, steps=2, batch=4))["ids"].shape[:3] == (3, 2, 4)
    with pytest.raises(ValueError, match="unknown alternative 'jax'"):
        users.build("jax", users.UserConfig("cnn", 1))


def test_a_missing_pfl_venv_is_reported_not_hidden(
    case: ModuleType, users: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(case, "PFL_PYTHON", "/nonexistent/python")
    cfg = users.UserConfig("cnn", 1, steps=1, batch=2)
    row, first, _ = case.measure(cfg, ("torch_loop", "pfl"), rounds=1)
    assert "not available: no pfl venv" in row["alternatives"]["pfl"]["error"]
    assert "not available" in first["alternatives"]["pfl"]["error"]
    assert row["alternatives"]["torch_loop"]["reps"] == 1
    assert row["alternatives"]["torch_loop"]["memory"]["peak_rss_mb"] > 0


@pytest.mark.slow
def test_a_tiny_run_computes_the_same_first_round_everywhere(
    case: ModuleType, users: ModuleType
) -> None:
    configs = [users.UserConfig(m, 2, steps=2, batch=4) for m in users.MODELS]
    result = case.run(_quick_ctx(), configs=configs, rounds=1)
    ids = [row["id"] for row in result.rows]
    assert ids == [f"users/{m}/c2{suffix}" for m in users.MODELS for suffix in ("", " first round")]
    pfl_here = importlib.import_module("os").path.exists(case.PFL_PYTHON)
    for row in result.rows[::2]:
        assert list(row["alternatives"]) == list(case.DEFAULT_ALTERNATIVES)
        for name, entry in row["alternatives"].items():
            if name == "pfl" and not pfl_here:
                assert "not available" in entry["error"]
                continue
            assert "error" not in entry, (row["id"], name, entry)
            assert entry["reps"] == 1
            assert len(entry["load"]) == 1
            assert entry["memory"]["peak_rss_mb"] > entry["memory"]["import_rss_mb"] > 0
        differences = row["params"]["max_abs_difference_after_first_round"]
        assert set(differences) == set(row["alternatives"]) - {"torch_loop"} - (
            set() if pfl_here else {"pfl"}
        )
        atol = case.AGREEMENT_ATOL[row["params"]["model"]]
        assert max(differences.values()) < atol, (row["id"], differences)
    descriptions = [t["description"] for t in result.targets]
    assert descriptions == [
        "bridge_mr (default strategy) round / torch_loop round",
        "bridge_mr (default strategy) round / pfl round",
    ]
    assert result.targets[0]["value"] > 0
