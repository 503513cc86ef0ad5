"""jax_core.map_reduce: every strategy gives vmap's values and gradients; chunks bound memory."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_all_close
from helpers.child import run_python
from jax.sharding import AxisType

from bridge_mr import jax_core as mr

N = 7  # Not divisible by the chunk size 3.
#: (strategy, chunk_size): uneven chunks, a chunk size above N, chunks of one, per client, and
#: "packed" (without convolutions: chunks; with them: tests/jax_core/test_packed.py).
LOOPED = [("chunks", 3), ("chunks", 10), ("chunks", 1), ("per_client", None), ("packed", 3)]
REDUCTIONS = ["mean", "sum", "weighted_mean"]
# float32: a loop adds the clients in another order than vmap's reduction.
CLOSE = {"rtol": 2e-5, "atol": 2e-6}


def _client(params, batch):
    """A loss, a params-shaped output and an int count (the reductions' dtype rules)."""
    hidden = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    loss = jnp.mean((hidden.sum(-1) - batch["y"]) ** 2)
    return {"loss": loss, "delta": params["w"] * loss, "count": jnp.sum(batch["y"] > 0)}


def _float_client(params, batch):
    out = _client(params, batch)
    return {"loss": out["loss"], "delta": out["delta"]}


def _case(n=N, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(2,)), jnp.float32),
    }
    clients = {
        "x": jnp.asarray(rng.normal(size=(n, 4, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, 4)), jnp.float32),
    }
    weights = jnp.asarray(rng.uniform(0.5, 1.5, size=(n,)), jnp.float32)
    return params, clients, weights


def _round(reduce, strategy, chunk_size, fn=None, **kwargs):
    # Strict promotion: an int count times a float weight is an error, as it is for vmap.
    fn = fn or (_float_client if reduce == "weighted_mean" else _client)

    def run(params, clients, weights):
        return mr.map_reduce(
            fn,
            params,
            clients,
            reduce=reduce,
            weights=weights if reduce == "weighted_mean" else None,
            strategy=strategy,
            chunk_size=chunk_size,
            **kwargs,
        )

    return run


def _scalar(reduce, strategy, chunk_size, **kwargs):
    run = _round(reduce, strategy, chunk_size, fn=_float_client, **kwargs)

    def total(params, clients, weights):
        out = run(params, clients, weights)
        return out["loss"] + jnp.sum(jnp.sin(out["delta"]))

    return total


@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize(("strategy", "chunk_size"), LOOPED)
def test_values_and_gradients_equal_vmap(reduce, strategy, chunk_size):
    args = _case()
    want = _round(reduce, "vmap", None)(*args)
    got_eager = _round(reduce, strategy, chunk_size)(*args)
    got_jit = jax.jit(_round(reduce, strategy, chunk_size))(*args)
    assert_trees_all_close(got_eager, want, **CLOSE, check_dtype=True)
    assert_trees_all_close(got_jit, want, **CLOSE, check_dtype=True)
    grad = jax.grad(_scalar(reduce, "vmap", None), argnums=(0, 1, 2))
    got_grad = jax.jit(jax.grad(_scalar(reduce, strategy, chunk_size), argnums=(0, 1, 2)))
    assert_trees_all_close(got_grad(*args), grad(*args), **CLOSE)


@pytest.mark.parametrize(("strategy", "chunk_size"), LOOPED)
def test_second_order_and_forward_mode_equal_vmap(strategy, chunk_size):
    params, clients, weights = _case()

    def hessian(strategy, chunk_size):
        f = _scalar("weighted_mean", strategy, chunk_size)
        return jax.jacfwd(jax.grad(lambda b: f({**params, "b": b}, clients, weights)))(params["b"])

    assert_trees_all_close(hessian(strategy, chunk_size), hessian("vmap", None), **CLOSE)


@pytest.mark.parametrize(("strategy", "chunk_size"), LOOPED)
def test_vmap_of_the_whole_program_equals_vmap(strategy, chunk_size):
    params, clients, weights = _case()
    seeds = {k: jnp.stack([v, 2 * v, -v]) for k, v in params.items()}

    def batched(strategy, chunk_size):
        run = _round("weighted_mean", strategy, chunk_size)
        return jax.jit(jax.vmap(run, in_axes=(0, None, None)))(seeds, clients, weights)

    assert_trees_all_close(batched(strategy, chunk_size), batched("vmap", None), **CLOSE)


@pytest.mark.parametrize(("strategy", "chunk_size"), LOOPED)
@pytest.mark.parametrize("shape", ["pair", "single"])
def test_tuple_client_data_equals_vmap(strategy, chunk_size, shape):
    """Client data that is a tuple reaches fn as one argument, as with vmap."""
    params, clients, _ = _case()
    data = (clients["x"], clients["y"]) if shape == "pair" else (clients["x"],)

    def fn(p, batch):
        x = batch[0]
        target = batch[1] if len(batch) == 2 else 0.0
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]).sum(-1) - target) ** 2)

    def run(strategy, chunk_size):
        return jax.value_and_grad(
            lambda p: mr.map_reduce(fn, p, data, strategy=strategy, chunk_size=chunk_size)
        )(params)

    assert_trees_all_close(run(strategy, chunk_size), run("vmap", None), **CLOSE)


def test_weights_shaped_like_the_outputs():
    params, clients, weights = _case()
    per_leaf = {"loss": weights, "delta": jnp.broadcast_to(weights[:, None, None], (N, 3, 2))}
    for strategy, chunk_size in LOOPED:
        got = mr.map_reduce(
            _float_client,
            params,
            clients,
            reduce="weighted_mean",
            weights=per_leaf,
            strategy=strategy,
            chunk_size=chunk_size,
        )
        want = mr.map_reduce(
            _float_client, params, clients, reduce="weighted_mean", weights=weights
        )
        assert_trees_all_close(got, want, **CLOSE)


def test_bfloat16_accumulates_in_float32():
    values = jnp.full((64, 2), 300.0, jnp.bfloat16)
    for strategy, chunk_size in [("vmap", None), *LOOPED]:
        got = mr.map_reduce(
            lambda s, c: c * s, jnp.ones((), jnp.bfloat16), values, reduce="sum",
            strategy=strategy, chunk_size=chunk_size,
        )  # fmt: skip
        assert got.dtype == jnp.bfloat16
        assert_trees_all_close(got, np.full(2, 19200.0), rtol=1e-2)


@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize(
    ("strategy", "chunk_size"), [("chunks", 4), ("chunks", 16), ("per_client", None)]
)
def test_sharded_over_an_auto_mesh_equals_unsharded(reduce, strategy, chunk_size):
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Auto,))
    args = _case(n=11)
    want = _round(reduce, "vmap", None)(*args)
    want_grad = jax.grad(_scalar(reduce, "vmap", None), argnums=(0, 1, 2))(*args)
    got_grad_f = jax.jit(jax.grad(_scalar(reduce, strategy, chunk_size), argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        got = jax.jit(_round(reduce, strategy, chunk_size))(*args)
        got_grad = got_grad_f(*args)
    assert_trees_all_close(got, want, **CLOSE)
    assert_trees_all_close(got_grad, want_grad, **CLOSE)
    explicit_arg = jax.jit(_round(reduce, strategy, chunk_size, mesh=mesh))(*args)
    assert_trees_all_close(explicit_arg, want, **CLOSE)


def test_chunks_shard_each_chunk_over_the_placement_axis():
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Auto,))
    args = _case(n=32)
    with jax.set_mesh(mesh):
        hlo = jax.jit(_round("mean", "chunks", 16)).lower(*args).as_text()
    assert "clients" in hlo  # The chunk's client axis is constrained to the mesh axis.
    assert "sharding_constraint" in hlo or "mhlo.sharding" in hlo


def test_an_explicit_placement_axis_is_refused_with_the_fix():
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Explicit,))
    params, clients, _ = _case(n=8)
    with pytest.raises(ValueError, match=r"strategy='chunks'.*Explicit.*strategy='vmap'.*Auto"):
        mr.map_reduce(_client, params, clients, strategy="chunks", chunk_size=4, mesh=mesh)


def test_packed_on_a_mesh_with_the_placement_is_refused_with_the_fix():
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Auto,))
    params, clients, _ = _case(n=8)
    with pytest.raises(ValueError, match=r"strategy='packed'.*'clients'.*strategy='chunks'"):
        mr.map_reduce(_client, params, clients, strategy="packed", chunk_size=4, mesh=mesh)


def test_a_symbolic_client_count_needs_vmap():
    (n,) = jax.export.symbolic_shape("n")
    params, _, _ = _case()
    specs = {
        "x": jax.ShapeDtypeStruct((n, 4, 3), jnp.float32),
        "y": jax.ShapeDtypeStruct((n, 4), jnp.float32),
    }

    def run(strategy, chunk_size=None):
        return lambda c: mr.map_reduce(
            _float_client, params, c, strategy=strategy, chunk_size=chunk_size
        )

    jax.export.export(jax.jit(run("vmap")))(specs)
    with pytest.raises(ValueError, match=r"strategy='per_client'.*symbolic size n.*'vmap'"):
        jax.export.export(jax.jit(run("per_client")))(specs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "loop"}, r"map_reduce\(strategy=\.\.\.\): expected one of 'vmap'.*'loop'"),
        ({"strategy": "chunks"}, r"map_reduce\(chunk_size=\.\.\.\): .*positive int.*None"),
        ({"strategy": "chunks", "chunk_size": 0}, r"chunk_size=\.\.\.\).*positive int.*0"),
        ({"strategy": "chunks", "chunk_size": True}, r"chunk_size=\.\.\.\).*bool: True"),
        ({"strategy": "chunks", "chunk_size": 2.0}, r"chunk_size=\.\.\.\).*float: 2.0"),
        ({"strategy": "packed"}, r"chunk_size=\.\.\.\): strategy='packed' needs a positive"),
        ({"chunk_size": 4}, r"chunk_size=4\) is only for strategy='chunks'.*'vmap'"),
        ({"reduce": "max"}, r"map_reduce\(reduce=\.\.\.\): expected one of"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    params, clients, _ = _case()
    with pytest.raises(ValueError, match=message):
        mr.map_reduce(_client, params, clients, **kwargs)


@pytest.mark.parametrize("mesh", ["clients", ("clients",)], ids=["str", "tuple"])
def test_a_mesh_that_is_not_a_mesh_names_the_argument_and_the_fix(mesh):
    params, clients, _ = _case()
    with pytest.raises(
        TypeError,
        match=r"^map_reduce\(mesh=\.\.\.\): expected a jax\.sharding\.Mesh or AbstractMesh \(with "
        rf"the placement axis 'clients'\).*; got {type(mesh).__name__} .*clients.*\. Fix: pass "
        r"the mesh itself, not an axis name",
    ):
        mr.map_reduce(_client, params, clients, mesh=mesh)


def test_client_count_is_the_leading_dimension_every_leaf_shares():
    clients = {"x": jnp.ones((3, 2)), "y": np.ones(3)}
    assert mr.client_count(clients) == 3
    assert mr.client_count({"x": jnp.ones((0, 2))}, empty_ok=True) == 0
    with pytest.raises(ValueError, match=r"the clients axis is empty"):
        mr.client_count({"x": jnp.ones((0, 2))})
    with pytest.raises(TypeError, match=r"clients\['x'\]\[0\] is a float"):
        mr.client_count({"x": [1.0]})
    with pytest.raises(TypeError, match=r"clients\['y'\] is a ndarray"):
        mr.client_count(clients, array_types=(jax.Array,))
    with pytest.raises(ValueError, match=r"disagree on the number of clients"):
        mr.client_count({"x": jnp.ones((3, 2)), "y": jnp.ones(4)})


def test_runs_without_a_program_and_ignores_an_outer_one():
    params, clients, weights = _case()
    want = mr.map_reduce(_float_client, params, clients, reduce="weighted_mean", weights=weights)
    with mr.program(placements={"clients": 3}):
        got = mr.map_reduce(
            _float_client, params, clients, reduce="weighted_mean", weights=weights,
            strategy="chunks", chunk_size=2,
        )  # fmt: skip
        assert mr.current_placement() == mr.Placement("clients", 3)
    assert_trees_all_close(got, want, **CLOSE)


_FEDAVG_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from bridge_mr import jax_core

    n, k = int(sys.argv[1]), int(sys.argv[2])
    params = {"w": jnp.full((256, 4096), 0.01, jnp.float32)}  # 1,048,576 parameters
    clients = {"x": jax.random.normal(jax.random.key(0), (n, 2, 256), jnp.float32)}
    counts = jnp.full((n,), 2.0, jnp.float32)

    def local_sgd(p, data):  # One local step; FedAvg averages the model deltas.
        loss = lambda q: jnp.mean(jnp.tanh(data["x"] @ q["w"]) ** 2)
        g = jax.grad(loss)(p)
        return jax.tree.map(lambda a, b: 0.1 * b, p, g)

    round_ = lambda p, c, w: jax_core.map_reduce(
        local_sgd, p, c, reduce="weighted_mean", weights=w, strategy="chunks", chunk_size=k)
    # The options bridge_mr's torch frontend compiles with (no YNNPACK reduce fusion here: with
    # jaxlib 0.10's default this round runs ~150x slower, jax-ml/jax#37465).
    options = jax_core.cpu_compiler_options(jax.make_jaxpr(round_)(params, clients, counts))
    assert options, "a chunked FedAvg round has a wide sum in its loop"
    fedavg = jax.jit(round_, compiler_options=options)
    delta = fedavg(params, clients, counts)
    jax.block_until_ready(delta)
    assert delta["w"].shape == (256, 4096) and bool(jnp.all(jnp.isfinite(delta["w"])))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of a large
    # pytest process would report at least the parent's peak. VmHWM is this address space's.
    status = open("/proc/self/status").read().splitlines()
    print(next(line for line in status if line.startswith("VmHWM:")).split()[1])  # KiB
    """
)


def test_fedavg_round_of_4096_clients_on_1m_parameters_in_chunks_of_32_under_2_gb():
    # Unchunked, the round holds 4096 deltas of 4 MiB each (16 GiB).
    # The child's XLA flags are set here, not inherited from an environment tests may change.
    flags = "--xla_force_host_platform_device_count=8"
    out = run_python(["-c", _FEDAVG_CHILD, "4096", "32"], env={"XLA_FLAGS": flags}, timeout=600)
    peak_kib = int(out.split()[-1])
    assert peak_kib * 1024 <= 2 * 2**30, f"peak RSS {peak_kib / 2**20:.2f} GiB"
