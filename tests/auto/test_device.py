"""The device is an input of auto's rules: checked on CPU with a GPU's description (an H200's).

Nothing runs but tracing: `auto.choose` reads each candidate's program from its jaxpr.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax

from bridge_mr import auto, jax_core
from bridge_mr.auto import _choose as choosing
from bridge_mr.auto import _device, settings

H200 = auto.DeviceDescription("gpu", "NVIDIA H200", 150_000_000_000)
SMALL_CPU = auto.DeviceDescription("cpu", "cpu", 64 * 2**30)
V5E = auto.DeviceDescription("tpu", "TPU v5 lite", 16 * 2**30)
#: TorchTPU's description of the same chip ("tpu" tensors; torch.tpu.get_device_properties).
TORCH_V5E = auto.DeviceDescription("torch_tpu", "TPU v5e", 16 * 2**30)
_keys = itertools.count()


@dataclasses.dataclass(frozen=True)
class _Trace:
    jaxpr: Any


def _program(fn, server, clients, weights, reduce, placement, mesh, strategy="vmap", chunk=None):
    return jax_core.map_reduce(
        fn, server, clients, reduce=reduce, weights=weights, placement=placement, mesh=mesh,
        strategy=strategy, chunk_size=chunk,
    )  # fmt: skip


def _trace(fn, server, client, placement, n):
    with jax_core.program(placements={placement: n}):
        return _Trace(jax.make_jaxpr(fn)(server, client))


def _never(*args):
    raise AssertionError("auto ran a candidate: only the cost model should decide here")


KIND = auto.RoundKind(_never, _program, _trace, auto.same, auto.same)


def _local_conv_steps(w: jax.Array, client: dict[str, jax.Array]) -> jax.Array:
    """Local SGD steps on a convolution: after the first step the weights are per client."""

    def step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.mean(lax.conv_general_dilated(x, w, (1, 1), "SAME") ** 2)

        return w - 0.1 * jax.grad(loss)(w), None

    return lax.scan(step, w, client["x"])[0] - w


def _mlp(params: dict[str, jax.Array], client: dict[str, jax.Array]) -> jax.Array:
    hidden = jnp.tanh(client["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"]) ** 2)


def _choose(fn, server, clients, device, monkeypatch) -> tuple[str, int | None]:
    monkeypatch.setattr(_device, "describe", lambda _: device)
    tensors = [*jax.tree.leaves(server), *jax.tree.leaves(clients)]
    args = (fn, server, clients, None, "mean", "clients", None)
    return auto.choose(("test_device", next(_keys)), tensors, args, None, KIND)


@pytest.fixture(autouse=True)
def _no_disk(monkeypatch):
    monkeypatch.setenv(auto.DISK_SWITCH, "0")


def _cnn(n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.zeros(4, 3, 3, 3), {"x": torch.zeros(n, 2, 2, 3, 8, 8)}


@pytest.mark.parametrize(
    ("clients", "expected", "ruled_out"),
    [(50, ("vmap", None), set()), (500, ("chunks", 16), {("vmap", None), ("chunks", 128)})],
    ids=["50", "500"],
)
def test_a_gpu_keeps_vmaps_grouped_convolutions_up_to_its_bound(
    clients, expected, ruled_out, monkeypatch
):
    # vmap groups the convolutions by client (50, 500 groups), chunks of K by K.
    assert _choose(_local_conv_steps, *_cnn(clients), H200, monkeypatch) == expected
    choice = auto.map_reduce_choices()[-1]
    ruled = {(c.strategy, c.chunk_size) for c in choice.candidates if "ruled out" in c.skipped}
    assert ruled == ruled_out
    by_option = {(c.strategy, c.chunk_size): c for c in choice.candidates}
    assert all("AUTO_GPU_MAX_CONV_GROUPS" in by_option[o].skipped for o in ruled_out)


@pytest.mark.parametrize("clients", [50, 500])
def test_a_cpu_rules_out_every_grouped_convolution(clients, monkeypatch):
    assert _choose(_local_conv_steps, *_cnn(clients), SMALL_CPU, monkeypatch) == (
        "per_client",
        None,
    )


@pytest.mark.parametrize("clients", [50, 500])
def test_a_tpu_packs_convolutions_over_per_client_weights(clients, monkeypatch):
    """Packed chunks of AUTO_TPU_PACKED first (the v5e's fastest CNN rounds), the grouped
    candidates ruled out; without packing per_client, and with a GPU's bound vmap or chunks."""
    assert _choose(_local_conv_steps, *_cnn(clients), V5E, monkeypatch) == ("packed", 2)
    choice = auto.map_reduce_choices()[-1]
    assert "AUTO_TPU_PACKED" in choice.reason
    skipped = {(c.strategy, c.chunk_size): c.skipped for c in choice.candidates}
    grouped = [o for o in skipped if o[0] in ("vmap", "chunks")]
    assert grouped
    assert all("AUTO_TPU_MAX_CONV_GROUPS" in skipped[o] for o in grouped)
    assert _choose(_local_conv_steps, *_cnn(clients), H200, monkeypatch)[0] != "packed"
    monkeypatch.setattr(settings, "AUTO_TPU_PACKED", None)
    assert _choose(_local_conv_steps, *_cnn(clients), V5E, monkeypatch) == ("per_client", None)
    monkeypatch.setattr(settings, "AUTO_TPU_MAX_CONV_GROUPS", 64)  # a GPU's bound
    expected = ("vmap", None) if clients == 50 else ("chunks", 16)
    assert _choose(_local_conv_steps, *_cnn(clients), V5E, monkeypatch) == expected


def test_torch_tpu_rules_out_grouped_convolutions_unless_told(monkeypatch):
    """On a chip TorchTPU runs (its programs compiled at "O3"), per_client measured faster than
    grouped convolutions (a 500-client CNN round from "tpu" tensors: 381 against 852 ms in
    chunks of 128); AUTO_TORCH_TPU_MAX_CONV_GROUPS = None keeps them."""
    assert _choose(_local_conv_steps, *_cnn(500), TORCH_V5E, monkeypatch) == ("per_client", None)
    choice = auto.map_reduce_choices()[-1]
    skipped = {(c.strategy, c.chunk_size): c.skipped for c in choice.candidates}
    assert all(
        "AUTO_TORCH_TPU_MAX_CONV_GROUPS" in skipped[o] for o in skipped if o[0] != "per_client"
    )
    monkeypatch.setattr(settings, "AUTO_TORCH_TPU_MAX_CONV_GROUPS", None)
    assert _choose(_local_conv_steps, *_cnn(500), TORCH_V5E, monkeypatch) == ("vmap", None)


@pytest.mark.parametrize("device", [V5E, TORCH_V5E], ids=["jax", "torch_tpu"])
def test_a_tpu_runs_clients_with_a_large_share_of_the_round_one_at_a_time(device, monkeypatch):
    params = {"w1": torch.zeros(64, 256), "w2": torch.zeros(256, 64)}
    clients = {"x": torch.zeros(8, 32, 64)}
    share = 2 * (2 * 32 * 64 * 256)  # one client's two products (no gradients here)
    monkeypatch.setattr(settings, "AUTO_TPU_CLIENT_FLOPS", share)
    assert _choose(_mlp, params, clients, device, monkeypatch) == ("per_client", None)
    choice = auto.map_reduce_choices()[-1]
    assert "AUTO_TPU_CLIENT_FLOPS" in choice.reason
    packed = [c for c in choice.candidates if c.strategy == "packed"]  # No convolution to pack.
    assert all("packing the clients runs no convolution" in c.skipped for c in packed)
    assert bool(packed) == (device is V5E)
    assert _choose(_mlp, params, clients, H200, monkeypatch) == ("vmap", None)
    assert _choose(_mlp, params, clients, SMALL_CPU, monkeypatch) == ("vmap", None)
    monkeypatch.setattr(settings, "AUTO_TPU_CLIENT_FLOPS", share + 1)
    assert _choose(_mlp, params, clients, device, monkeypatch) == ("vmap", None)


def test_on_a_tpu_a_candidate_needing_fewer_operations_still_replaces_per_client(monkeypatch):
    """per_client heads the preference on a TPU, and the margin still lets a candidate that
    needs fewer operations replace it (an AUTO_MARGIN above 1 makes vmap's equal count enough)."""
    params = {"w1": torch.zeros(64, 256), "w2": torch.zeros(256, 64)}
    clients = {"x": torch.zeros(8, 32, 64)}
    monkeypatch.setattr(settings, "AUTO_TPU_CLIENT_FLOPS", 1.0)
    monkeypatch.setattr(settings, "AUTO_MARGIN", 1.01)  # vmap's equal count is now "fewer"
    assert _choose(_mlp, params, clients, V5E, monkeypatch) == ("vmap", None)


def test_a_gpus_budget_is_half_its_memory_where_a_cpu_holds_vmap_to_the_leanest(monkeypatch):
    monkeypatch.setattr(settings, "AUTO_MEMORY_FLOOR", 0)
    params = {"w1": torch.zeros(64, 256), "w2": torch.zeros(256, 64)}
    clients = {"x": torch.zeros(128, 32, 64)}
    assert _choose(_mlp, params, clients, SMALL_CPU, monkeypatch) != ("vmap", None)
    on_cpu = auto.map_reduce_choices()[-1]
    assert on_cpu.memory_budget_bytes < SMALL_CPU.memory_bytes // 2  # the leanest's multiple
    assert _choose(_mlp, params, clients, H200, monkeypatch) == ("vmap", None)
    assert auto.map_reduce_choices()[-1].memory_budget_bytes == H200.memory_bytes // 2


def test_the_device_is_part_of_a_decisions_name_on_disk(monkeypatch):
    monkeypatch.setenv(auto.DISK_SWITCH, "1")
    before = set(auto.directory().glob("*.json")) if auto.directory().is_dir() else set()
    server, clients = _cnn(50)
    for device in (SMALL_CPU, H200):
        auto.forget_choices()
        _choose(_local_conv_steps, server, clients, device, monkeypatch)
    assert len(set(auto.directory().glob("*.json")) - before) == 2


def test_every_setting_is_part_of_a_decisions_name_on_disk(monkeypatch):
    monkeypatch.setenv(auto.DISK_SWITCH, "1")
    server, clients = _cnn(50)
    names = [name for name in vars(settings) if name.startswith("AUTO_")]
    assert len(settings.as_read_now()) == len(names)
    auto.forget_choices()
    _choose(_local_conv_steps, server, clients, H200, monkeypatch)
    before = set(auto.directory().glob("*.json"))
    monkeypatch.setattr(settings, "AUTO_TPU_PACKED", 4)  # the last one added
    auto.forget_choices()
    _choose(_local_conv_steps, server, clients, H200, monkeypatch)
    assert len(set(auto.directory().glob("*.json")) - before) == 1


def test_torch_tpu_still_rules_out_what_is_over_the_budget(monkeypatch):
    """Keeping grouped convolutions on TorchTPU's chip (AUTO_TORCH_TPU_MAX_CONV_GROUPS = None)
    does not keep what its memory cannot hold: on a chip of 64 KiB, vmap of 500 clients is
    over the budget there too."""
    small = auto.DeviceDescription("torch_tpu", "TPU v5e", 64 * 2**10)
    monkeypatch.setattr(settings, "AUTO_MEMORY_FLOOR", 0)
    monkeypatch.setattr(settings, "AUTO_TORCH_TPU_MAX_CONV_GROUPS", None)
    assert _choose(_local_conv_steps, *_cnn(500), small, monkeypatch) != ("vmap", None)
    choice = auto.map_reduce_choices()[-1]
    skipped = {(c.strategy, c.chunk_size): c.skipped for c in choice.candidates}
    assert "over the memory budget" in skipped[("vmap", None)]


@pytest.mark.parametrize(
    ("device", "kept"), [(V5E, "per_client"), (TORCH_V5E, "per_client"), (H200, "vmap")]
)
def test_timing_breaks_ties_toward_the_devices_preference(device, kept, monkeypatch):
    """With AUTO_TIMING, a tie keeps the preference's head (per_client on a TPU where each
    client's share is at least AUTO_TPU_CLIENT_FLOPS, else vmap); a candidate clearly
    (AUTO_MARGIN) faster than it still wins."""
    params = {"w1": torch.zeros(64, 256), "w2": torch.zeros(256, 64)}
    clients = {"x": torch.zeros(8, 32, 64)}
    monkeypatch.setattr(settings, "AUTO_TPU_CLIENT_FLOPS", 1.0)
    monkeypatch.setattr(settings, "AUTO_TIMING", True)
    seconds: dict[tuple[str, int | None], float] = {}

    def timed(args, ranked, grads, kind, tensors):
        return {o: [seconds.get(o, 1.0)] for o in ranked}, {}

    monkeypatch.setattr(choosing, "time_candidates", timed)
    other = ("vmap", None) if kept == "per_client" else ("per_client", None)
    seconds[other] = 0.95  # Faster, but within the margin: a tie.
    assert _choose(_mlp, params, clients, device, monkeypatch) == (kept, None)
    assert auto.map_reduce_choices()[-1].reason == f"no candidate beats {kept} by more than 10%"
    seconds[other] = 0.5
    auto.forget_choices()
    assert _choose(_mlp, params, clients, device, monkeypatch) == other
    assert auto.map_reduce_choices()[-1].reason == f"faster than {kept} by more than 10%"
