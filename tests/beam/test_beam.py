"""bridge_mr.beam: programs run as Beam pipelines equal jax.jit of the same programs."""

from __future__ import annotations

import pickle
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The torch-xla environment (.venv-xla) collects every module but has no Beam.
beam = pytest.importorskip("apache_beam")
from apache_beam.testing.util import assert_that  # noqa: E402
from helpers.beam import assert_close, jit_of  # noqa: E402
from helpers.child import run_python  # noqa: E402

import bridge_mr  # noqa: E402
import bridge_mr.beam as bb  # noqa: E402
from bridge_mr import jax_core as mr  # noqa: E402

F32 = np.float32
DIM, EXAMPLES = 3, 4


def local_steps(params, data):
    """client_work with local gradient steps: 3 SGD steps of a linear least-squares loss."""

    def loss(p):
        return jnp.mean((data["x"] @ p["w"] + p["b"] - data["y"]) ** 2)

    def step(p, _):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p)), loss(p)

    new, losses = jax.lax.scan(step, params, None, length=3)
    return jax.tree.map(jnp.subtract, new, params), losses[-1]


def fedavg_round(server, data, weight):
    """A weighted FedAvg round: several pytrees out (the new server and the mean loss)."""
    deltas, losses = mr.map_fn(local_steps, (mr.broadcast(server), data))
    update = mr.reduce_weighted_mean(deltas, weight)
    return jax.tree.map(jnp.add, server, update), mr.reduce_mean(losses)


def fedavg_unweighted(server, data, weight):
    del weight  # Unused: the plain mean.
    deltas, _ = mr.map_fn(local_steps, (mr.broadcast(server), data))
    return jax.tree.map(jnp.add, server, mr.reduce_mean(deltas))


def server0():
    return {"w": np.linspace(-1, 1, DIM).astype(F32), "b": F32(0.25)}


def records(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            {
                "x": rng.normal(size=(EXAMPLES, DIM)).astype(F32),
                "y": rng.normal(size=EXAMPLES).astype(F32),
            },
            F32(rng.uniform(0.5, 2.0)),
        )
        for _ in range(count)
    ]


# --- equal to jit -----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [fedavg_round, fedavg_unweighted], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("count", [1, 16])
def test_a_round_equals_jit(fn, count):
    recs = records(count)
    assert_close(bb.run(fn, (server0(),), recs, bundle_size=5), jit_of(fn, server0(), recs))


@pytest.mark.slow
@pytest.mark.parametrize("fn", [fedavg_round, fedavg_unweighted], ids=["weighted", "unweighted"])
def test_a_round_of_300_clients_equals_jit(fn):
    recs = records(317)
    assert_close(bb.run(fn, (server0(),), recs, bundle_size=64), jit_of(fn, server0(), recs))


@pytest.mark.slow
def test_three_consecutive_fedavg_rounds_equal_jit():
    server_beam = server_jit = server0()
    for r in range(3):
        recs = records(16, seed=r)
        server_beam, _ = bb.run(fedavg_round, (server_beam,), recs)
        server_jit, _ = jit_of(fedavg_round, server_jit, recs)
    assert_close(server_beam, server_jit, tol=1e-4)


def meta_gradient(server, data, weight):
    """The gradient of the post-round loss through the whole round (local steps included)."""

    def after_round(s):
        new, _ = fedavg_round(s, data, weight)
        losses = mr.map_fn(
            lambda p, d: jnp.mean((d["x"] @ p["w"] + p["b"] - d["y"]) ** 2),
            (mr.broadcast(new), data),
        )
        return mr.reduce_weighted_mean(losses, weight)

    return jax.value_and_grad(after_round)(server)


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 16, 317])
def test_a_gradient_through_map_and_reduce_equals_jit(count):
    recs = records(count)
    got = bb.run(meta_gradient, (server0(),), recs, bundle_size=64)
    assert_close(got, jit_of(meta_gradient, server0(), recs), tol=1e-4)
    # The backward pass of the round is further rounds of map/reduce.
    assert bb.split(meta_gradient, (server0(),), recs[0]).num_rounds >= 2


def two_rounds(server, data, weight):
    """A broadcast of a value computed after a reduction: two rounds of map/reduce."""
    mean_x = mr.reduce_mean(data["x"])
    spread = mr.map_fn(lambda x, m: jnp.sum((x - m) ** 2), (data["x"], mr.broadcast(mean_x)))
    return {"mean": mean_x, "spread": mr.reduce_weighted_mean(spread, weight) * server["b"]}


def sums_over_the_client_axis(server, data, weight):
    """reduce_sum and a contraction over the client axis written with jnp: sums over clients."""
    centered = data["x"] - jnp.mean(data["x"], axis=0)
    return jnp.sum(centered**2), jnp.einsum("c,cij->ij", weight, data["x"]) + server["w"]


@pytest.mark.parametrize("fn", [two_rounds, sums_over_the_client_axis])
def test_multi_round_programs_equal_jit(fn):
    recs = records(16)
    assert_close(bb.run(fn, (server0(),), recs, bundle_size=7), jit_of(fn, server0(), recs))


def assorted_client(table, tokens, key, scale):
    """Client work: a gather, randomness, cond, fori_loop, sort and cumsum (not over clients)."""
    embedded = table[tokens]  # A gather from the broadcast table by the client's tokens.
    noisy = embedded + 0.01 * jax.random.normal(key, embedded.shape)
    y = jax.lax.cond(scale > 1.0, lambda e: e * scale, lambda e: e - scale, noisy)
    y = jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + 1.0, y)
    return jnp.sort(y, axis=-1).sum() + jnp.cumsum(y, axis=0)[-1].sum()


def assorted(table, tokens, key, scale):
    values = mr.map_fn(assorted_client, (mr.broadcast(table), tokens, key, scale))
    return mr.reduce_mean(values), mr.reduce_sum(scale > 1.0)


@pytest.mark.slow
def test_assorted_client_work_equals_jit():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(10, 4)).astype(F32)
    recs = [
        (
            rng.integers(0, 10, size=5).astype(np.int32),
            np.asarray(jax.random.key_data(jax.random.PRNGKey(i))),  # A key per client.
            F32(rng.uniform(0.5, 1.5)),
        )
        for i in range(16)
    ]
    stacked = [jnp.asarray(np.stack(xs)) for xs in zip(*recs, strict=True)]
    expected = jax.jit(mr.program(clients=16)(assorted))(table, *stacked)
    assert_close(bb.run(assorted, (table,), recs, bundle_size=5), expected, tol=1e-4)


@jax.custom_vjp
def clipped_gradient(x):
    return x


clipped_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def with_custom_rules(server, data, weight):
    """A gradient through map/reduce of client work with custom_vjp, checkpoint and jit inside."""

    def loss(s):
        def client(p, d):
            return jnp.sum(jax.checkpoint(jnp.tanh)(clipped_gradient(d["x"] @ p["w"])))

        return mr.reduce_weighted_mean(mr.map_fn(client, (mr.broadcast(s), data)), weight)

    return jax.grad(loss)(server), jax.jit(loss)(server)


def test_custom_vjp_checkpoint_and_jit_inside_equal_jit():
    recs = records(8)
    got = bb.run(with_custom_rules, (server0(),), recs, bundle_size=3)
    assert_close(got, jit_of(with_custom_rules, server0(), recs), tol=1e-4)


def test_the_plan_has_the_phases_of_distribute_aggregate_form():
    plan = bb.split(two_rounds, (server0(),), records(1)[0])
    assert [s.name for s in plan.segments] == [
        "server_0",
        "client_0",
        "server_1",
        "client_1",
        "server_2",
    ]
    # sum(weight) needs no broadcast: it is aggregated in round 0, with the mean.
    assert [[r.kind for r in rs] for rs in plan.aggregations] == [["mean", "sum"], ["sum"]]


def test_interpret_runs_the_plan_in_any_bundling():
    recs = records(7)
    plan = bb.split(fedavg_round, (server0(),), recs[0])
    expected = jit_of(fedavg_round, server0(), recs)
    for sizes in ([7], [1] * 7, [3, 4], [2, 1, 4]):
        assert_close(bb.interpret(plan, (server0(),), recs, bundle_sizes=sizes), expected)


# --- the PTransform form ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_transform_composes_into_a_users_pipeline_and_run_takes_a_pcollection():
    recs = records(12)
    expected = jit_of(fedavg_round, server0(), recs)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), recs[0])

    def matches(results):  # Runs inside the pipeline.
        assert len(results) == 1
        assert_close(results[0], expected)

    with beam.Pipeline(runner=bb.DEFAULT_RUNNER) as p:
        result = (
            p | beam.Create(recs) | bb.MapReduce(fedavg_round, (server0(),), spec, bundle_size=5)
        )
        assert_that(result, matches)
    pipeline = beam.Pipeline(runner=bb.DEFAULT_RUNNER)
    pcoll = pipeline | beam.Create(recs)
    assert_close(bb.run(fedavg_round, (server0(),), pcoll, record_spec=spec), expected)


# --- refusals ---------------------------------------------------------------------------------


def one_client(server, data, weight):
    return mr.reduce_sum(data["x"][0] + data["x"])


def cumsum_over_clients(server, data, weight):
    return mr.reduce_sum(jnp.cumsum(data["x"], axis=0))


def sort_over_clients(server, data, weight):
    return mr.reduce_sum(jnp.sort(weight))


def client_index(server, data, weight):
    index = jnp.arange(weight.shape[0], dtype=jnp.float32)
    return mr.reduce_sum(weight * index)


def pairwise_matmul(server, data, weight):
    return jnp.sum(jnp.einsum("cij,dij->cd", data["x"], data["x"]))


def merged_client_axis(server, data, weight):
    return jnp.sum(data["x"].reshape(-1) ** 2)


def convolution_over_clients(server, data, weight):
    images = data["x"][None]  # [1, n, 4, 3]: the clients as the channels of one image
    kernel = images[:, :, :2, :2]  # [1, n, 2, 2]: a convolution summing over clients
    return jnp.sum(jax.lax.conv(images, kernel, (1, 1), "SAME"))


def closure_over_placed(server, data, weight):
    return mr.reduce_sum(mr.map_fn(lambda w: w * jnp.sum(weight), weight))


def placed_result(server, data, weight):
    return mr.map_fn(lambda w: w * 2, weight)


def rounds_in_a_scan(server, data, weight):
    def round_(s, _):
        return s + mr.reduce_mean(mr.map_fn(lambda p, w: p * w, (mr.broadcast(s), weight))), None

    return jax.lax.scan(round_, server["b"], None, length=2)[0]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (one_client, r"dynamic_slice.*selects or mixes clients outside a reduction"),
        (cumsum_over_clients, r"cumsum\[axis=0.* is a cumsum over the client axis"),
        (sort_over_clients, r"sort\[dimension=0.* sorts along the client axis"),
        (client_index, r"iota\[.* reads the client index"),
        (pairwise_matmul, r"float32\[n,n\].*pairs every client with every other"),
        (placed_result, r"result is a placed value \(float32\[n\]\)"),
        (merged_client_axis, r"reshape.*float32\[12\*n\].*merges clients with another axis"),
        (convolution_over_clients, r"conv_general_dilated.* selects or mixes clients"),
        (closure_over_placed, r"placed_map.* reads a placed value whole inside map_fn"),
        (rounds_in_a_scan, r"placed_broadcast.* is a broadcast inside a scan"),
    ],
)
def test_programs_beam_cannot_express_are_refused_at_split_time(fn, match):
    with pytest.raises(bb.UnsupportedProgramError, match=match):
        bb.split(fn, (server0(),), records(1)[0])


# --- client records ---------------------------------------------------------------------------


def test_a_record_with_a_wrong_shape_or_dtype_is_named():
    recs = records(5)
    recs[3] = ({**recs[3][0], "x": np.zeros((EXAMPLES + 1, DIM), F32)}, recs[3][1])
    with pytest.raises(ValueError, match=r"client record 3, leaf 0: expected float32\[4, 3\], got"):
        bb.run(fedavg_round, (server0(),), recs)
    recs = records(5)
    recs[2] = (recs[2][0], np.int32(1))
    with pytest.raises(
        ValueError, match=r"client record 2, leaf 2: expected float32\[\], got int32"
    ):
        bb.run(fedavg_round, (server0(),), recs)
    recs = records(5)
    recs[4] = (recs[4][0],)
    with pytest.raises(ValueError, match=r"client record 4 has structure"):
        bb.run(fedavg_round, (server0(),), recs)


def test_a_bad_record_in_a_pcollection_is_named_by_its_types():
    spec = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), records(1)[0]
    )
    recs = records(3)
    recs[1] = ({**recs[1][0], "y": np.zeros(EXAMPLES + 2, F32)}, recs[1][1])
    pipeline = beam.Pipeline(runner=bb.DEFAULT_RUNNER)
    pcoll = pipeline | beam.Create(recs)
    with pytest.raises(ValueError, match=r"a client record, leaf 1: expected float32\[4\], got"):
        bb.run(fedavg_round, (server0(),), pcoll, record_spec=spec)


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="client_records is empty"):
        bb.run(fedavg_round, (server0(),), [])


# --- the CombineFn ----------------------------------------------------------------------------


def test_the_aggregation_merges_partial_accumulators_in_any_order_and_tree_shape():
    recs = records(9)
    plan = bb.split(fedavg_round, (server0(),), recs[0])
    combine = bb.Aggregate(plan.aggregations[0])
    rng = np.random.default_rng(1)
    contributions = [  # One bundle per client, float32 values of the reductions' shapes.
        [rng.normal(size=(1, *r.shape)).astype(F32) for r in plan.aggregations[0]] for _ in recs
    ]

    def leaf_acc(c):
        return combine.add_input(combine.create_accumulator(), c)

    def result(acc):
        return combine.finish([combine.extract_output(acc)])

    flat = combine.create_accumulator()
    for c in contributions:
        flat = combine.add_input(flat, c)
    expected = result(flat)
    assert expected[0] == 9
    leaves = [leaf_acc(c) for c in contributions]
    shapes = {
        "reversed": combine.merge_accumulators(leaves[::-1]),
        "balanced": combine.merge_accumulators(
            [
                combine.merge_accumulators(leaves[:4]),
                combine.merge_accumulators([combine.merge_accumulators(leaves[4:6]), *leaves[6:]]),
            ]
        ),
        "with empties": combine.merge_accumulators(
            [
                combine.create_accumulator(),
                *leaves[::2],
                combine.create_accumulator(),
                *leaves[1::2],
            ]
        ),
        "right fold": leaves[-1],
    }
    for acc in leaves[-2::-1]:
        shapes["right fold"] = combine.merge_accumulators([acc, shapes["right fold"]])
    partials = [combine.extract_output(acc) for acc in leaves]  # One per partition, say.
    for name, (count, values) in [
        *((name, result(acc)) for name, acc in shapes.items()),
        ("several partials", combine.finish(partials[::-1])),
    ]:
        assert count == 9, name
        for got, want in zip(values, expected[1], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    # float64 accumulation: the mean of float32 contributions is the float64 mean, rounded once.
    means = [r.kind == "mean" for r in plan.aggregations[0]]
    i = means.index(True)
    exact = np.mean(np.concatenate([c[i] for c in contributions]).astype(np.float64), axis=0)
    np.testing.assert_array_equal(expected[1][i], exact.astype(F32))


def test_the_aggregation_of_no_client_is_an_error():
    plan = bb.split(fedavg_round, (server0(),), records(1)[0])
    combine = bb.Aggregate(plan.aggregations[0])
    with pytest.raises(ValueError, match="no client records reached the aggregation"):
        combine.finish([combine.extract_output(combine.create_accumulator())])
    with pytest.raises(ValueError, match="no client records reached the aggregation"):
        combine.finish([])


# --- workers import jax and numpy only --------------------------------------------------------

_WORKER_CHILD = textwrap.dedent(
    """
    import pickle, sys, types
    import numpy as np
    for name in ("bridge_mr", "bridge_mr.beam"):  # Stand-ins: their __init__ does not run.
        stub = types.ModuleType(name)
        stub.__path__ = [sys.argv[1] + ("/beam" if name.endswith("beam") else "")]
        sys.modules[name] = stub
    plan, server, stacked, expected = pickle.loads(open(sys.argv[2], "rb").read())
    from bridge_mr.beam import _worker
    got = _worker.interpret(plan, server, stacked, [2, 1])
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "apache_beam", "torchax"))
    ours = sorted(m for m in sys.modules if m.startswith("bridge_mr."))
    print(heavy, ours)
    """
)


@pytest.mark.slow
def test_a_worker_unpickles_and_runs_segments_with_jax_and_numpy_only(tmp_path):
    recs = records(3)
    plan = bb.split(fedavg_round, (server0(),), recs[0])
    stacked = [np.stack(xs) for xs in zip(*(jax.tree.leaves(r) for r in recs), strict=True)]
    expected = jax.tree.leaves(jit_of(fedavg_round, server0(), recs))
    path = tmp_path / "plan.pkl"
    leaves = [np.asarray(x) for x in jax.tree.leaves(server0())]
    path.write_bytes(pickle.dumps((plan, leaves, stacked, [np.asarray(x) for x in expected])))
    package = str(bridge_mr.__path__[0])
    out = run_python(["-c", _WORKER_CHILD, package, str(path)], timeout=300)
    # The stand-in package itself, the plain-data plan and the worker; _caches imports the
    # standard library only.
    ours = ["_caches", "beam", "beam._plan", "beam._worker"]
    assert out.splitlines()[-1] == f"[] {[f'bridge_mr.{name}' for name in ours]}"
