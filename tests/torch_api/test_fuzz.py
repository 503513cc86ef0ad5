"""Differential fuzzing: map_reduce and the torch-level primitives against pure-torch loops.

Each case draws random pytrees (dicts, tuples, lists, nested, with an occasional empty subtree)
of 1-4 server leaves (0-d to 3-d) and 1-4 client leaves ([n, ...], 0-3 trailing dims), 1-17
clients, a client function, a reduction and (for "weighted_mean") positive weights, either
one vector [n] or a pytree shaped like the output. Leaves may be non-contiguous (transposed,
strided with gaps, at an unaligned storage offset, expanded with stride 0). The bridge's
values and gradients (of sum(output * cotangent), the cotangent random or exactly 1) w.r.t.
the server, client and weight leaves that require grad are checked against the same client
function run in torch, one client at a time, with torch autograd. Three modes: float64 under
x64 (rtol 1e-10), float32 with x64 off (`jax.enable_x64(False)` around the call and its
backward; rtol 1e-4) and float32 with x64 on (rtol 1e-4); the two under x64 are marked `x64`
and run in the x64 test leg (BRIDGE_MR_X64=1, see tests/conftest.py). A leaf matches when
|got - want| <= rtol * (max(1, max |want|) + |want|) everywhere. The same cases run through
`map_reduce`, through `broadcast` / `map_fn` / `reduce_*` under `program`, and through a
`torch_function` of the JAX-level primitives. Two more tests: results own their memory
(writes to inputs, outputs and gradients right after a call change nothing else), and two
threads tracing and running differently shaped calls at once equal the same calls in turn.

Every example compiles (its shapes are new), so each test has a fixed seed and a small
budget, and the client functions are a few module-level ones (keyed by value, so never
retraced for nothing). The last test, `test_fuzz_summary` (one per leg), prints the figures
(cases, mismatches, max abs and normwise rel error, per test and mode) and what the cases
covered. The harness (modes, cases, the torch reference, the comparison) is
tests/helpers/fuzz.py.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import pytest
import torch
from helpers.fuzz import (
    BODIES,
    EXACT,
    FEATURES,
    MODES,
    ROUND,
    TALLY,
    Built,
    Case,
    Mode,
    Tally,
    build,
    cases,
    check_values_and_grads,
    compare,
    fuzz,
    fuzz_settings,
    reduce_reference,
    requires_grad_problems,
    settle,
    tally_of,
)
from hypothesis import given, seed
from hypothesis import strategies as st

import bridge_mr

# ---------------------------------------------------------------------------------------------
# The fuzz tests.


def _legs(*rows: tuple[str, int, int]) -> list[Any]:
    """(mode, examples, seed) parameters; the modes under x64 run in the x64 leg."""
    return [
        pytest.param(*row, id=row[0], marks=[pytest.mark.x64] if MODES[row[0]].x64 else [])
        for row in rows
    ]


def _map_reduce(built: Built) -> Any:
    return bridge_mr.map_reduce(
        built.jax_body,
        built.server,
        built.clients,
        reduce=built.case.reduce,
        weights=built.weights,
    )


def _run_map_reduce(case: Case, mode: Mode) -> None:
    built = build(case, mode)
    with jax.enable_x64(mode.x64):
        out = _map_reduce(built)
        grads = built.grads(out)
    check_values_and_grads("map_reduce", built, out, grads)


@pytest.mark.parametrize(
    ("mode", "examples", "seed_value"),
    _legs(("x64-f64", 50, 1), ("x32-f32", 40, 2), ("x64-f32", 16, 3)),
)
def test_map_reduce_equals_a_torch_loop(mode, examples, seed_value):
    fuzz(_run_map_reduce, MODES[mode], examples, seed_value)


def _run_primitives(case: Case, mode: Mode) -> None:
    built = build(case, mode)
    tally = tally_of("primitives", mode)
    with jax.enable_x64(mode.x64), bridge_mr.program(placements={"clients": case.n}):
        placed = bridge_mr.broadcast(built.server)
        results = bridge_mr.map_fn(built.jax_body, (placed, built.clients))
        if case.reduce == "sum":
            out = bridge_mr.reduce_sum(results)
        elif case.reduce == "mean":
            out = bridge_mr.reduce_mean(results)
        else:
            out = bridge_mr.reduce_weighted_mean(results, built.weights)
        grads = built.grads(out)
    expanded = jax.tree.map(lambda s: s.detach().expand(case.n, *s.shape), built.server)
    problems = compare(placed, expanded, mode, tally, "broadcast")
    stacked = jax.tree.map(lambda *xs: torch.stack(xs).detach(), *built.per_client)
    problems += compare(results, stacked, mode, tally, "map_fn")
    problems += compare(out, built.expected, mode, tally, "reduction")
    problems += requires_grad_problems(out, bool(built.diff), "reduction")
    problems += compare(grads, built.expected_grads, mode, tally, "grad")
    settle("primitives", built, problems)


@pytest.mark.parametrize(
    ("mode", "examples", "seed_value"), _legs(("x64-f64", 12, 4), ("x32-f32", 6, 5))
)
def test_torch_level_primitives_equal_a_torch_loop(mode, examples, seed_value):
    fuzz(_run_primitives, MODES[mode], examples, seed_value)


def _run_torch_function(case: Case, mode: Mode) -> None:
    built = build(case, mode)
    with jax.enable_x64(mode.x64):
        out = ROUND(built.server, built.clients, built.weights, case.reduce, built.jax_body)
        grads = built.grads(out)
    check_values_and_grads("torch_function", built, out, grads)


@pytest.mark.parametrize(
    ("mode", "examples", "seed_value"), _legs(("x64-f64", 15, 6), ("x32-f32", 10, 7))
)
def test_torch_function_of_jax_primitives_equals_a_torch_loop(mode, examples, seed_value):
    fuzz(_run_torch_function, MODES[mode], examples, seed_value)


# ---------------------------------------------------------------------------------------------
# Aliasing: results own their memory.


def _clone_tree(tree: Any) -> Any:
    return jax.tree.map(lambda t: t.detach().clone(), tree)


def _scribble(tensors: list[torch.Tensor], *, positive: bool = False) -> None:
    """Overwrites the tensors in place (weights stay positive, so their sums stay far from 0)."""
    with torch.no_grad():
        for t in tensors:
            if positive:
                t.mul_(0.5).add_(0.3)
            else:
                t.mul_(-0.5).add_(0.25)


def _write_each(
    leaves: list[torch.Tensor], tally: Tally, what: str, bystanders: list[torch.Tensor]
) -> list[str]:
    """Adds 1000 to each of `leaves` in turn: only that one changes, `bystanders` never."""
    want = _clone_tree(leaves)
    kept_bystanders = _clone_tree(bystanders)
    problems = []
    for i, leaf in enumerate(leaves):
        with torch.no_grad():
            leaf.add_(1000)
            want[i].add_(1000)
        problems += compare(leaves, want, EXACT, tally, f"{what}s after writing {what} {i}")
        problems += compare(
            bystanders, kept_bystanders, EXACT, tally, f"inputs after writing {what} {i}"
        )
    return problems


def _run_aliasing(case: Case, mode: Mode, big: bool) -> None:
    built = build(case, mode)
    tally = tally_of("aliasing", mode)
    server = built.server
    if big:  # Large enough to be imported zero-copy, not packed with the small ones.
        gen = torch.Generator().manual_seed(case.seed)
        big_leaf = torch.randn(100, 200, dtype=mode.dtype, generator=gen)
        FEATURES["aliasing: 160/80 KB server leaf"] += 1
        server = {"tree": server, "big": big_leaf}
        built = dataclasses.replace(built, server=server)
    values = [*jax.tree.leaves(built.server), *jax.tree.leaves(built.clients)]
    inputs = [*values, *jax.tree.leaves(built.weights)]
    with jax.enable_x64(mode.x64):
        out = _map_reduce(built)
    out_leaves = jax.tree.leaves(out)
    kept = _clone_tree(out)
    problems = []
    # 1. Writing to every input right after the call changes no result.
    _scribble(values)
    _scribble(jax.tree.leaves(built.weights), positive=True)
    problems += compare(out, kept, EXACT, tally, "outputs after writing the inputs")
    # 2. Backward still gives the gradients at the inputs forward saw (or refuses).
    if not big:
        try:
            with jax.enable_x64(mode.x64):
                grads = built.grads(out)
        except RuntimeError as err:
            if "modified" not in str(err):  # Refusing, as torch itself does, is fine.
                raise
            FEATURES["aliasing: backward after writes refused"] += 1
        else:
            FEATURES["aliasing: backward after writes"] += 1
            problems += compare(grads, built.expected_grads, mode, tally, "grads after writes")
            # Gradients share memory with nothing else either.
            problems += _write_each(grads, tally, "grad", [])
    # 3. Writing to one output changes no other output and no input.
    problems += _write_each(out_leaves, tally, "output", inputs)
    # 4. The cached program reads the inputs' new values.
    with jax.enable_x64(mode.x64), torch.no_grad():
        again = _map_reduce(built)
    torch_body = BODIES[case.body][1]
    with torch.no_grad():
        per_client = [
            torch_body(built.server, jax.tree.map(lambda c, i=i: c[i], built.clients))
            for i in range(case.n)
        ]
        stacked = jax.tree.map(lambda *xs: torch.stack(xs), *per_client)
        want = reduce_reference(stacked, case.reduce, built.weights, case.weights)
    problems += compare(again, want, mode, tally, "second call on the written inputs")
    settle("aliasing", built, problems)


_ALIASING_CASES = cases(
    bodies=("passthrough", "passthrough", "tree", "dot"),
    layouts=("contiguous", "transposed", "gapped", "offset"),  # Not expanded: not writable.
)


@pytest.mark.parametrize(
    ("mode", "examples", "seed_value"), _legs(("x64-f64", 8, 8), ("x32-f32", 6, 9))
)
def test_results_do_not_alias_inputs_or_each_other(mode, examples, seed_value):
    @seed(seed_value)
    @fuzz_settings(examples)
    @given(case=_ALIASING_CASES, big=st.booleans())
    def run(case, big):
        _run_aliasing(case, MODES[mode], big)

    run()


# ---------------------------------------------------------------------------------------------
# Threads.


def _thread_cases() -> list[tuple[Case, Mode]]:
    def case(n, server, clients, body, reduce, weights=None, seed_value=0):
        return Case(
            n=n,
            server={"p": tuple(range(len(server)))},
            clients=[tuple(range(len(clients)))],
            server_leaves=tuple((shape, True, "contiguous") for shape in server),
            client_leaves=tuple((shape, i == 0, "contiguous") for i, shape in enumerate(clients)),
            body=body,
            reduce=reduce,
            weights=weights,
            weights_grad=weights is not None,
            unit_cotangent=False,
            seed=seed_value,
        )

    f64, f32 = MODES["x64-f64"], MODES["x32-f32"]
    return [
        (case(6, [(3, 5), (2,)], [(4, 3)], "matmul", "mean", seed_value=1), f64),
        (case(11, [(), (2, 2, 2)], [(2,), (1, 3)], "tree", "weighted_mean", "tree", 2), f64),
        (case(7, [(5,)], [(2, 5), ()], "dot", "sum", seed_value=3), f64),
        (case(9, [(2, 4)], [(3, 2)], "matmul", "weighted_mean", "vector", 4), f32),
        (case(13, [(3,), (1, 2)], [(3, 3, 1)], "tree", "sum", seed_value=5), f32),
        (case(5, [(2, 1, 3)], [(3,)], "dot", "mean", seed_value=6), f32),
    ]


def test_two_threads_with_different_shapes_equal_sequential_calls():
    """Two threads (one float64 under x64, one float32 with x64 off: JAX's flag is per
    thread) trace, compile and run their own signatures at once; then the same calls in turn."""
    work = _thread_cases()
    groups = [[w for w in work if w[1].x64], [w for w in work if not w[1].x64]]
    built = {id(c): build(c, m) for c, m in work}

    def run(group, results, barrier=None):
        if barrier is not None:
            barrier.wait()
        for repeat in range(5):
            for case, mode in group:
                b = built[id(case)]
                with jax.enable_x64(mode.x64):
                    out = _map_reduce(b)
                    grads = b.grads(out)
                results[(id(case), repeat)] = (_clone_tree(out), _clone_tree(grads))

    threaded: dict[Any, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def target(group):
        try:
            run(group, threaded, barrier)
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(group,)) for group in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    sequential: dict[Any, Any] = {}
    for group in groups:
        run(group, sequential)
    assert threaded.keys() == sequential.keys()
    for key, (out, grads) in threaded.items():
        want_out, want_grads = sequential[key]
        scratch = Tally()
        problems = compare(out, want_out, EXACT, scratch, "threaded value")
        problems += compare(grads, want_grads, EXACT, scratch, "threaded grad")
        assert scratch.max_abs == 0, problems
        assert not problems, problems
    for case, _ in work:
        b = built[id(case)]
        out, grads = threaded[(id(case), 0)]
        check_values_and_grads("threads", b, out, grads, live=False)


def test_enable_x64_false_reaches_the_bridge():
    """The x32 mode is real: under jax.enable_x64(False) the bridge refuses float64 tensors."""
    built = build(_thread_cases()[2][0], MODES["x64-f64"])
    with jax.enable_x64(False), pytest.raises(TypeError, match="64-bit mode"):
        _map_reduce(built)


# ---------------------------------------------------------------------------------------------
# Summary (keep last).


@pytest.mark.parametrize("leg", [pytest.param("x64", marks=pytest.mark.x64), "x32"])
def test_fuzz_summary(leg, capsys):
    """Prints cases, mismatches and the largest errors seen per test kind and mode (once per
    test leg: each runs its own modes)."""
    del leg  # Only selects the leg.
    lines = [
        "bridge_mr fuzz summary (kind, mode: cases, leaves compared, mismatches, max abs/rel):"
    ]
    by_mode: dict[str, Tally] = {}
    for (kind, mode), t in sorted(TALLY.items()):
        lines.append(
            f"  {kind:15s} {mode:8s} cases={t.cases:4d} leaves={t.leaves:5d} "
            f"mismatches={t.mismatches} max_abs={t.max_abs:.3g} max_rel={t.max_rel:.3g}"
        )
        total = by_mode.setdefault(mode, Tally())
        total.cases += t.cases
        total.leaves += t.leaves
        total.mismatches += t.mismatches
        total.max_abs = max(total.max_abs, t.max_abs)
        total.max_rel = max(total.max_rel, t.max_rel)
    for mode, t in sorted(by_mode.items()):
        lines.append(
            f"  {'ALL':15s} {mode:8s} cases={t.cases:4d} leaves={t.leaves:5d} "
            f"mismatches={t.mismatches} max_abs={t.max_abs:.3g} max_rel={t.max_rel:.3g}"
        )
    lines.append("covered (per built case, or per leaf):")
    features = sorted(FEATURES.items())
    for start in range(0, len(features), 4):
        lines.append("  " + ", ".join(f"{k}: {v}" for k, v in features[start : start + 4]))
    text = "\n".join(lines)
    with capsys.disabled():  # Shown without -s too.
        print("\n" + text)
    if not TALLY:
        pytest.skip("no fuzz test ran in this session")
    assert all(t.mismatches == 0 for t in TALLY.values()), text
