"""The studies without a test of their own run on a tiny input and print their tables
(`bench_flags`: test_bench_flags.py)."""

from __future__ import annotations

import functools
import itertools
import json
import pathlib

import numpy as np
import pytest
import torch
from helpers.bench import benchmark
from helpers.precision import assert_leaves_close, precisions


@pytest.mark.slow
def test_bench_cnn_options_checks_and_times_each_variant(capsys: pytest.CaptureFixture) -> None:
    study = benchmark("studies.bench_cnn_options")
    status = study.main(["--clients", "2", "--reps", "2", "--variants", "per_client", "pair"])
    assert status == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| per_client |", "| pair |"))]
    assert len(rows) == 2, out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["seconds"]) == {"per_client", "pair"}
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
    assert result["difference"]["per_client"] == 0.0
    assert result["difference"]["pair"] < 1e-4  # The same round, two clients per scan step.


def test_bench_zoo_times_a_model_against_torch_eager(capsys: pytest.CaptureFixture) -> None:
    study = benchmark("studies.bench_zoo")
    assert study.main(["--rounds", "2", "cnn_groupnorm"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| `cnn_groupnorm` |")]
    assert len(row) == 1, out
    cells = [cell.strip() for cell in row[0].strip("|").split("|")]
    assert all(float(cell) > 0 for cell in cells[1:5]), row


def test_bench_zoo_refuses_an_unknown_model() -> None:
    with pytest.raises(SystemExit):
        benchmark("studies.bench_zoo").main(["no_such_model"])


def test_bench_conv_lowering_times_each_lowering_from_the_same_server(
    capsys: pytest.CaptureFixture,
) -> None:
    import torch

    study = benchmark("studies.bench_conv_lowering")
    argv = ["--device", "cpu", "--rows", "2:medium", "--reps", "1", "--chunks", "1"]
    study.main([*argv, "--grouped", "1", "--packed", "1", "--unroll", "5", "--convolutions"])
    out = capsys.readouterr().out
    # The "medium" row's torch round ran at "medium"; the process's setting is as it was (a
    # leaked "medium" moved the demo's torch baselines, tests/demo, by 2e-4 in CI).
    assert torch.get_float32_matmul_precision() == "highest"
    rows = [line for line in out.splitlines() if line.startswith("| cnn/c2/medium |")]
    variants = [row.split("|")[2].strip() for row in rows]
    want = ["pure_jax", "matmul", "matmul:chunks:1", "chunks:1", "packed:1", "packed:1:u5"]
    want.append("packed:1:conv")
    assert variants == [*want, "bridge_mr"], out
    for row in rows:  # Each variant's round against pure JAX's, from the same parameters.
        assert float(row.split("|")[8]) < 1e-5, row
    timed = [json.loads(line) for line in out.splitlines() if '"median_s"' in line]
    assert [r["variant"] for r in timed] == variants
    assert all(r["median_s"] > 0 and r["flops"] > 0 for r in timed)


def test_bench_conv_lowering_reads_a_trace_without_a_device_plane_as_no_device_ops() -> None:
    import jax
    import jax.numpy as jnp

    study = benchmark("studies.bench_conv_lowering")
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    # On CPU, XLA's work runs on host threads: the trace has no "/device:" plane to sum.
    assert study.device_ops(lambda: f(x).block_until_ready()) == {"device_us": 0, "ops": []}


def test_profile_call_times_the_tiny_call_beside_pure_jax_and_profiles_it(
    capsys: pytest.CaptureFixture,
) -> None:
    import torch

    before = torch.get_float32_matmul_precision()
    study = benchmark("studies.profile_call")
    study.main(["--calls", "3", "--reps", "2", "--top", "5", "--precision", "medium"])
    out = capsys.readouterr().out
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    medians = {e["name"]: e for e in events if e["event"] == "median"}
    assert set(medians) == {"bridge_mr", "pure_jax", "pure_jax_transfers"}
    assert medians["pure_jax_transfers"]["over_pure_jax_transfers_us"] == 0
    assert all(e["us"] > 0 for e in events if e["event"] == "rep")
    assert "cProfile of 3 calls" in out
    assert "Ordered by: internal time" in out
    assert torch.get_float32_matmul_precision() == before


def test_profile_torch_tpu_times_a_rounds_parts_and_replays_saved_programs(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    before = torch.get_float32_matmul_precision()
    study = benchmark("studies.profile_torch_tpu")
    study.main(["--device", "cpu", "--clients", "2", "--rounds", "1", "--save", str(tmp_path)])
    out = capsys.readouterr().out
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    (medians,) = [e for e in events if e["event"] == "medians"]
    assert all(medians[part] > 0 for part in ("round", "mean_delta", "server_step"))
    assert medians["program"] == 0  # host tensors: no TorchTPU program runs
    assert torch.get_float32_matmul_precision() == before
    # What --save writes for TorchTPU's programs, replayed as JAX runs them.
    with study._capturing_exports(tmp_path):
        jax.export.export(jax.jit(lambda x, n: jnp.sin(x) * n.astype(x.dtype)), platforms=("cpu",))(
            jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
        )
    assert [p.name for p in tmp_path.iterdir()] == ["program_0.bin"]
    assert jax.export.export.__module__.startswith("jax")  # restored
    study.main(["--replay", str(tmp_path), "--rounds", "2"])
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["replay", "replay_medians"]
    assert events[1]["program_0.bin"] > 0


def test_bench_cnn_forms_pools_route_ties_as_reduce_window() -> None:
    import jax
    import jax.numpy as jnp

    study = benchmark("studies.bench_cnn_forms")
    x = jnp.round(jax.random.normal(jax.random.key(0), (2, 3, 8, 6)))  # many ties
    x = x.at[0, 0, :2, :2].set(jnp.nan)  # a window of NaNs
    weights = jax.random.normal(jax.random.key(1), (2, 3, 4, 3))
    for nhwc in (False, True):
        y = jnp.transpose(x, (0, 2, 3, 1)) if nhwc else x
        w = jnp.transpose(weights, (0, 2, 3, 1)) if nhwc else weights
        reshaped, windowed = (
            study.pool_reshape(nhwc),
            functools.partial(study.pool_reduce_window, nhwc=nhwc),
        )
        got = jax.grad(lambda v, pool=reshaped, w=w: jnp.nansum(pool(v) * w))(y)
        want = jax.grad(lambda v, pool=windowed, w=w: jnp.nansum(pool(v) * w))(y)
        assert jnp.array_equal(reshaped(y), windowed(y), equal_nan=True)
        assert jnp.array_equal(got, want), (nhwc, got - want)


@pytest.mark.parametrize(("dtype", "rtol"), precisions(float64=1e-12, float32=1e-5))
def test_bench_cnn_forms_packed_clients_get_each_their_own_gradient(
    dtype: torch.dtype, rtol: float
) -> None:
    import jax
    import jax.numpy as jnp

    study = benchmark("studies.bench_cnn_forms")
    to = jnp.float64 if dtype == torch.float64 else jnp.float32
    server = jax.tree.map(lambda a: a.astype(to), study.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    groups = 3
    images = jnp.asarray(rng.standard_normal((groups, 2, 3, 32, 32)), to)
    labels = jnp.asarray(rng.integers(0, 10, (groups, 2)), jnp.int32)
    # Each client's parameters its own, as after a local step.
    params = jax.tree.map(
        lambda a: a * jnp.arange(1, groups + 1, dtype=to).reshape(-1, *[1] * a.ndim), server
    )
    for layout, dot in itertools.product(("nchw", "nhwc"), (False, True)):
        one, packed = (
            study.make_loss("rs", layout, dot),
            study.make_packed_loss(groups, "rs", layout, dot),
        )
        got = jax.grad(packed)(params, images, labels)
        for g in range(groups):
            mine = jax.tree.map(lambda a, g=g: a[g], params)
            want = jax.grad(one)(mine, images[g], labels[g])
            assert_leaves_close(
                jax.tree.map(lambda a, g=g: a[g], got), want, rtol, f"{layout} dot={dot} {g}"
            )


@pytest.mark.x64
def test_bench_cnn_forms_packed_round_is_the_per_client_round_in_float64() -> None:
    """Two groups of two clients, each client its own images and its own steps in order, the
    mean over all four: the round of one client at a time (in float32 a ReLU input or a
    max-pool tie that rounds the other way moves them apart by up to ~1e-3: compare in float64),
    with the local steps and the clients' loop unrolled too, with clients or groups vmapped a
    step, and with the first linear layer over the packed channels."""
    import jax
    import jax.numpy as jnp

    study = benchmark("studies.bench_cnn_forms")
    server = jax.tree.map(lambda a: a.astype(jnp.float64), study.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    images = rng.standard_normal((4, 2, 3, 3, 32, 32))  # clients, steps, batch, C, H, W
    labels = rng.integers(0, 10, (4, 2, 3)).astype(np.int32)
    want = jax.jit(study.make_round("map:rs:nchw"))(server, images, labels)
    for variant in (
        "pack2:rs:nchw", "pack4:rs:nhwc:dot", "pack2:rs:nchw:u2:o2", "map:rs:nchw:o3",
        "pack2:rs:nchw:u2:v2", "map:rs:nchw:o2:v2", "pack2:rs:nchw:lanes",
        "pack4:rs:nhwc:lanes:u2", "pack2:rs:nchw:lanes:v2", "pack2:rs:nchw:lanesstep",
    ):  # fmt: skip
        got = jax.jit(study.make_round(variant))(server, images, labels)
        deltas = [jax.tree.map(jnp.subtract, r, server) for r in (got, want)]
        assert_leaves_close(*deltas, 1e-11, variant)


@pytest.mark.slow
def test_bench_cnn_forms_runs_each_form_from_the_same_server(capsys: pytest.CaptureFixture) -> None:
    study = benchmark("studies.bench_cnn_forms")
    variants = [
        "vmap:rw:nchw", "map:rs:nchw", "map:rs:nhwc", "map:rs:nchw:dot", "map:rs:nhwc:dot",
        "pack2:rs:nchw",
    ]  # fmt: skip
    argv = ["--rows", "2:highest", "--variants", *variants, "--reps", "1", "--cpu-reference"]
    assert study.main(argv) == 0
    out = capsys.readouterr().out
    done = [json.loads(line) for line in out.splitlines() if '"median_s"' in line]
    assert [r["variant"] for r in done] == variants
    assert all(r["median_s"] > 0 and r["tflop_per_s"] > 0 for r in done)
    by = {r["variant"]: r for r in done}
    assert by["map:rs:nchw"]["error_vs_first"] == 0.0  # The same arithmetic on the CPU.
    for other in variants[2:]:  # Sums in another order.
        assert by[other]["error_vs_first"] < 1e-4, by[other]
    assert set(by["map:rs:nchw"]["error_vs_cpu"]) == {
        "b1",
        "b2",
        "c1",
        "c2",
        "d1",
        "d2",
        "l1",
        "l2",
    }
    for wrong in (
        ["--variants", "vmap:rw"],
        ["--variants", "pack1:rs:nchw"],
        ["--variants", "pack2:rs:nchw:o2:u5"],  # u before o
        ["--variants", "vmap:rs:nchw:o2"],  # no loop over clients to unroll
        ["--variants", "vmap:rs:nchw:v2"],  # vmap over every client already
        ["--variants", "pack2:rs:nchw:v2:o2"],  # o before v
        ["--variants", "map:rs:nchw:lanes"],  # no packed channels
        ["--variants", "pack2:rs:nchw:dot:lanes"],  # one or the other
        ["--variants", "pack2:rs:nchw:lanes:lanesstep"],
    ):
        with pytest.raises(SystemExit):
            study.main(wrong)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        study.main(["--rows", "3:highest", "--variants", "pack2:rs:nchw"])
    assert "do not divide the row 3:highest's clients" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_conv_precision_compares_each_form_with_the_cpu(
    capsys: pytest.CaptureFixture,
) -> None:
    study = benchmark("studies.bench_conv_precision")
    assert study.main(["--clients", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    conv = [r for r in lines if r["part"] == "conv"]
    assert len(conv) == len(study.SHAPES) * len(study.PRECISIONS) * 2
    step = [r for r in lines if r["part"] == "step"]
    assert [r["form"] for r in step] == ["vmap", "map"]
    # On a machine without a chip both sides are the CPU: rounding apart, nothing differs.
    assert all(r[k] < 1e-5 for r in conv for k in ("y", "dx", "dw")), conv
    assert all(r["relu_sign_flips"] == [0, 0] for r in step)
    assert all(r[k] < 1e-5 for r in step for k in ("loss", "c1", "c2", "l1")), step
