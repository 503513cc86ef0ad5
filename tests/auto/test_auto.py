"""map_reduce(strategy="auto"): one trace of the client, a cost model before any timing, the
picked program kept, the decisions on disk. Asserted through trace counts and
`map_reduce_choices()`, never through timings."""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.child import run_python
from helpers.rounds import case as _case
from helpers.rounds import delta as _delta
from helpers.rounds import loss as _loss

import bridge_mr
from bridge_mr import auto
from bridge_mr.auto import _pick, settings
from bridge_mr.torch_api import map_reduce

CLOSE = {"rtol": 2e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each test decides afresh: no choice in memory, its own (empty) decisions directory."""
    monkeypatch.setenv("BRIDGE_MR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BRIDGE_MR_AUTO_DISK", raising=False)
    bridge_mr.clear_caches()
    yield
    bridge_mr.clear_caches()


def _conv(w, x):
    """F.conv2d's layouts (NCHW input, OIHW kernel)."""
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )


def _cnn_loss(w, batch):
    return jnp.mean((jnp.tanh(_conv(w, batch["x"])).mean(axis=(1, 2, 3)) - batch["y"]) ** 2)


def _local_step(w, batch):
    """FedAvg's client: a local SGD step, then the loss of the client's own new weights (a
    convolution over per-client weights)."""
    local = w - 0.1 * jax.grad(_cnn_loss)(w, batch)
    return _cnn_loss(local, batch)


def _cnn_case(n=20):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, 3, 3, generator=gen)
    clients = {
        "x": torch.randn(n, 2, 3, 8, 8, generator=gen),
        "y": torch.randn(n, 2, generator=gen),
    }
    return w, clients


def _labels(choice):
    return [(c.strategy, c.chunk_size) for c in choice.candidates]


def test_dense_clients_keep_vmap_by_the_cost_model_without_running_another(caplog):
    params, clients, _ = _case(n=20)
    for p in params.values():
        p.requires_grad_()
    before = bridge_mr.trace_counts()["map_reduce"]
    with caplog.at_level(logging.DEBUG, logger="bridge_mr"):
        losses = [map_reduce(_loss, params, clients) for _ in range(3)]
    for loss in losses:
        loss.backward()
    # One program traced: the call's own (fused value and gradient), kept for the later calls.
    assert bridge_mr.trace_counts()["map_reduce"] - before == 1
    (choice,) = bridge_mr.map_reduce_choices()
    assert _labels(choice) == [("vmap", None), ("per_client", None), ("chunks", 16)]
    assert (choice.strategy, choice.chunk_size) == ("vmap", None)
    assert "cost model" in choice.reason
    assert not choice.from_disk
    assert all(c.seconds is None and c.timed_calls == 0 for c in choice.candidates)
    assert all(c.flops and c.flops > 0 and c.memory_bytes for c in choice.candidates)
    assert all("prefers vmap" in c.skipped for c in choice.candidates[1:])
    # per_client recomputes each client's forward in the backward pass (checkpointed loop).
    assert choice.candidates[1].flops > choice.candidates[0].flops
    assert "map_reduce(loss, server=" in choice.signature
    assert "with gradients" in choice.signature
    (record,) = [r for r in caplog.records if "strategy='auto'" in r.getMessage()]
    assert "picked vmap" in record.getMessage()
    assert "per_client" in record.getMessage()
    with torch.no_grad():  # Another signature (no gradients): decided once more.
        map_reduce(_loss, params, clients)
    assert len(bridge_mr.map_reduce_choices()) == 2
    assert "with gradients" not in bridge_mr.map_reduce_choices()[1].signature
    bridge_mr.clear_caches()
    assert bridge_mr.map_reduce_choices() == []


@pytest.mark.parametrize("gradients", [False, True])
def test_convolutions_over_per_client_weights_rule_out_vmap_and_chunks_untried(gradients):
    w, clients = _cnn_case()
    w.requires_grad_(gradients)
    before = bridge_mr.trace_counts()["map_reduce"]
    got = map_reduce(_local_step, w, clients)
    # Only per_client's program was traced (and compiled, and run): vmap and chunks never.
    assert bridge_mr.trace_counts()["map_reduce"] - before == 1
    (choice,) = bridge_mr.map_reduce_choices()
    assert (choice.strategy, choice.chunk_size) == ("per_client", None)
    assert choice.reason == "the only candidate the cost model did not rule out"
    ruled_out = {(c.strategy, c.chunk_size): c.skipped for c in choice.candidates}
    assert "grouped convolution" in ruled_out["vmap", None]
    assert "grouped convolution" in ruled_out["chunks", 16]
    assert ruled_out["per_client", None] == ""
    assert all(c.seconds is None for c in choice.candidates)
    with torch.no_grad():
        want = map_reduce(_local_step, w, clients, strategy="vmap")
    assert_trees_all_close(got.detach(), want, rtol=1e-5, atol=1e-6)


def test_convolutions_over_the_server_weights_keep_vmap():
    w, clients = _cnn_case()
    map_reduce(_cnn_loss, w.requires_grad_(), clients).backward()  # FedSGD: shared weights
    (choice,) = bridge_mr.map_reduce_choices()
    assert choice.strategy == "vmap"
    assert not any("grouped" in c.skipped for c in choice.candidates)


def test_an_impure_client_function_is_traced_once_per_signature():
    runs = []

    def counted(params, batch):
        runs.append(1)  # A side effect at trace time, as jax.jit runs it: once per signature.
        return _loss(params, batch)

    params, clients, _ = _case(n=20)
    w = params["w"].requires_grad_()
    map_reduce(counted, params, clients).backward()
    assert len(runs) == 1
    before = bridge_mr.trace_counts()["map_reduce"]
    map_reduce(counted, params, clients).backward()  # The picked program, kept: no new trace.
    assert len(runs) == 1
    assert bridge_mr.trace_counts()["map_reduce"] == before
    assert w.grad is not None


def test_timing_mode_traces_the_client_once_and_keeps_the_winner(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_TIMING", True)
    monkeypatch.setattr(settings, "AUTO_TIME_BOX", math.inf)  # Time every candidate left.
    monkeypatch.setattr(settings, "AUTO_MIN_SECONDS", 0.0)
    runs = []

    def counted(params, batch):
        runs.append(1)
        return _loss(params, batch)

    params, clients, _ = _case(n=20)
    for p in params.values():
        p.requires_grad_()
    before = bridge_mr.trace_counts()["map_reduce"]
    map_reduce(counted, params, clients).backward()
    (choice,) = bridge_mr.map_reduce_choices()
    assert len(runs) == 1  # Three candidates compiled and timed from one trace of the client.
    assert all(c.seconds is not None and c.seconds > 0 for c in choice.candidates)
    # The fastest first call is within AUTO_GIVE_UP of itself: that candidate is timed fully.
    assert max(c.timed_calls for c in choice.candidates) == settings.AUTO_REPEATS
    # Each candidate's program was traced once, in map_reduce itself, and kept: the winner
    # runs later calls without tracing or compiling again.
    traced = bridge_mr.trace_counts()["map_reduce"] - before
    assert traced == 3
    map_reduce(counted, params, clients).backward()
    assert bridge_mr.trace_counts()["map_reduce"] - before == traced
    seconds = {(c.strategy, c.chunk_size): c.seconds or 0.0 for c in choice.candidates}
    if choice.strategy != "vmap":  # The rule: another strategy only when clearly faster.
        picked = seconds[choice.strategy, choice.chunk_size]
        assert picked < settings.AUTO_MARGIN * seconds["vmap", None]


def test_timing_stops_a_candidate_that_cannot_win(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_TIMING", True)
    monkeypatch.setattr(settings, "AUTO_TIME_BOX", math.inf)
    monkeypatch.setattr(settings, "AUTO_MIN_SECONDS", 0.0)
    # Every first timed call is "over 0x the fastest": no candidate is timed twice.
    monkeypatch.setattr(settings, "AUTO_GIVE_UP", 0.0)
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    (choice,) = bridge_mr.map_reduce_choices()
    assert len(choice.candidates) == 3
    assert all(c.timed_calls == 1 and c.seconds is not None for c in choice.candidates)


def test_timing_keeps_a_fast_vmap_without_trying_the_others(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_TIMING", True)
    monkeypatch.setattr(settings, "AUTO_TIME_BOX", math.inf)
    monkeypatch.setattr(settings, "AUTO_MIN_SECONDS", math.inf)  # Any vmap is "fast".
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    (choice,) = bridge_mr.map_reduce_choices()
    vmap, *others = choice.candidates
    assert choice.strategy == "vmap"
    assert vmap.seconds is not None
    assert all(c.seconds is None and "AUTO_MIN_SECONDS" in c.skipped for c in others)


def test_timing_stays_within_the_time_box(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_TIMING", True)
    monkeypatch.setattr(settings, "AUTO_TIME_BOX", 0.0)  # No time for a second candidate.
    monkeypatch.setattr(settings, "AUTO_MIN_SECONDS", 0.0)
    params, clients, _ = _case(n=20)
    before = bridge_mr.trace_counts()["map_reduce"]
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    (choice,) = bridge_mr.map_reduce_choices()
    vmap, *others = choice.candidates
    assert choice.strategy == "vmap"
    assert vmap.seconds is not None
    assert all(c.seconds is None and "AUTO_TIME_BOX" in c.skipped for c in others)
    assert bridge_mr.trace_counts()["map_reduce"] - before == 1


def test_auto_equals_vmap():
    def grads(strategy):
        params, clients, weights = _case()
        leaves = [*(p.requires_grad_() for p in params.values()), weights.requires_grad_()]
        out = map_reduce(
            _delta, params, clients, reduce="weighted_mean", weights=weights, strategy=strategy
        )
        return out, torch.autograd.grad(sum(o.sin().sum() for o in out.values()), leaves)

    assert_trees_all_close(grads("auto"), grads("vmap"), **CLOSE)


def test_a_memory_budget_rules_out_candidates():
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients, memory_budget_bytes=1)
    (choice,) = bridge_mr.map_reduce_choices()
    assert choice.memory_budget_bytes == 1
    assert all(c.seconds is None and "memory budget" in c.skipped for c in choice.candidates)
    assert "memory budget" in choice.reason
    estimates = {(c.strategy, c.chunk_size): c.memory_bytes for c in choice.candidates}
    assert all(e is not None and e > 0 for e in estimates.values())
    least = min(choice.candidates, key=lambda c: c.memory_bytes or 0)
    assert (choice.strategy, choice.chunk_size) == (least.strategy, least.chunk_size)


def test_auto_rules_out_a_candidate_needing_many_times_the_leanest_memory(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_MEMORY_FLOOR", 0)
    # Each client makes a [512, 512] intermediate: vmap holds 32 of them, chunks of 16 hold 16.
    outer = lambda s, c: jnp.tanh(c[:, None] * s[None, :]).mean()
    gen = torch.Generator().manual_seed(5)
    server, clients = torch.randn(512, generator=gen), torch.randn(32, 512, generator=gen)
    got = map_reduce(outer, server, clients)
    (choice,) = bridge_mr.map_reduce_choices()
    memory = {c.strategy: c.memory_bytes or 0 for c in choice.candidates}
    assert choice.memory_budget_bytes == settings.AUTO_MEMORY_FACTOR * memory["per_client"]
    assert memory["vmap"] > 16 * memory["per_client"]
    assert choice.strategy == "per_client"
    assert all(
        "memory budget" in c.skipped for c in choice.candidates if c.strategy != "per_client"
    )
    assert_trees_all_close(got, map_reduce(outer, server, clients, strategy="vmap"), **CLOSE)


def test_jax_inputs_run_vmap_without_measuring():
    params, clients, _ = _case()
    as_jax = [{k: jnp.asarray(v.numpy()) for k, v in tree.items()} for tree in (params, clients)]
    out = bridge_mr.map_reduce(_loss, *as_jax)
    assert_trees_all_close(out, map_reduce(_loss, params, clients, strategy="vmap"))
    assert bridge_mr.map_reduce_choices() == []


def _decision_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "auto").glob("*.json"))


def test_a_decision_is_read_back_from_disk_without_deciding_again(tmp_path, monkeypatch):
    w, clients = _cnn_case()
    map_reduce(_local_step, w, clients)
    (kept,) = _decision_files(tmp_path)
    assert json.loads(kept.read_text())["strategy"] == "per_client"
    (first,) = bridge_mr.map_reduce_choices()
    bridge_mr.clear_caches()  # Forgets the choices in memory, not those on disk.
    assert _decision_files(tmp_path) == [kept]
    monkeypatch.setattr(_pick, "ruled_out", None)  # Deciding again would fail.
    map_reduce(_local_step, w, clients)
    (again,) = bridge_mr.map_reduce_choices()
    assert again.from_disk
    assert not first.from_disk
    assert (again.strategy, again.candidates, again.reason) == (
        first.strategy,
        first.candidates,
        first.reason,
    )


def test_another_process_reads_the_decision(tmp_path):
    script = tmp_path / "second.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, torch, bridge_mr

            def loss(w, x):
                return jnp.mean(jnp.tanh(x @ w) ** 2)

            w = torch.ones(3, 2, requires_grad=True)
            bridge_mr.map_reduce(loss, w, torch.ones(20, 4, 3)).backward()
            (choice,) = bridge_mr.map_reduce_choices()
            print(choice.from_disk, choice.strategy)
            """
        )
    )
    env = {"BRIDGE_MR_CACHE_DIR": str(tmp_path / "cache")}
    assert run_python([str(script)], env=env).split() == ["False", "vmap"]
    assert len(_decision_files(tmp_path)) == 1
    assert run_python([str(script)], env=env).split() == ["True", "vmap"]
    env["BRIDGE_MR_AUTO_DISK"] = "0"  # Off: decided again.
    assert run_python([str(script)], env=env).split() == ["False", "vmap"]


def test_the_disk_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGE_MR_AUTO_DISK", "0")  # As os.environ set in code does.
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    assert _decision_files(tmp_path) == []
    bridge_mr.clear_caches()
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    assert not bridge_mr.map_reduce_choices()[0].from_disk


def test_a_corrupt_decision_is_decided_again_and_rewritten(tmp_path):
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    (kept,) = _decision_files(tmp_path)
    for garbage in ("{not json", '{"format": 1, "strategy": "fast"}', "[]"):
        kept.write_text(garbage)
        bridge_mr.clear_caches()
        with torch.no_grad():
            map_reduce(_loss, params, clients)
        (choice,) = bridge_mr.map_reduce_choices()
        assert not choice.from_disk
        assert choice.strategy == "vmap"
        assert json.loads(kept.read_text())["strategy"] == "vmap"  # Rewritten.


def test_an_unwritable_cache_directory_never_fails_a_call(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("BRIDGE_MR_CACHE_DIR", str(blocker))  # Its "auto" cannot be created.
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    assert bridge_mr.map_reduce_choices()[0].strategy == "vmap"
    assert auto.forget_all() == 0


def test_forget_all_deletes_the_decisions_on_disk(tmp_path):
    params, clients, _ = _case(n=20)
    with torch.no_grad():
        map_reduce(_loss, params, clients)
    assert len(_decision_files(tmp_path)) == 1
    assert auto.forget_all() == 1
    assert _decision_files(tmp_path) == []


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("BRIDGE_MR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert auto.directory() == tmp_path / "xdg" / "bridge_mr" / "auto"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert auto.directory() == tmp_path / "home" / ".cache" / "bridge_mr" / "auto"
    monkeypatch.setenv("BRIDGE_MR_AUTO_DISK", "0")
    assert auto.directory() is None
