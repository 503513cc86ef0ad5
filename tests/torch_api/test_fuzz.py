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
covered.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import bridge_mr
from bridge_mr import jax_core

# ---------------------------------------------------------------------------------------------
# Modes and the module-level tally the summary reports.


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    dtype: torch.dtype
    x64: bool
    rtol: float


EXACT = Mode("exact", torch.float64, x64=True, rtol=0.0)  # For copies: bit for bit.
MODES = {
    "x64-f64": Mode("x64-f64", torch.float64, x64=True, rtol=1e-10),
    "x32-f32": Mode("x32-f32", torch.float32, x64=False, rtol=1e-4),
    "x64-f32": Mode("x64-f32", torch.float32, x64=True, rtol=1e-4),
}


@dataclasses.dataclass
class Tally:
    cases: int = 0
    mismatches: int = 0
    leaves: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0


# (test kind, mode name) -> Tally.
TALLY: dict[tuple[str, str], Tally] = {}


def _tally(kind: str, mode: Mode) -> Tally:
    return TALLY.setdefault((kind, mode.name), Tally())


def _fuzz_settings(max_examples: int) -> Callable[[Any], Any]:
    # A fixed seed per test (and no example database): every run tries the same cases.
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=False)


def _fuzz(
    run_case: Callable[[Case, Mode], None], mode: Mode, examples: int, seed_value: int
) -> None:
    """Runs `run_case` on `examples` generated cases, reproducibly from `seed_value`."""

    @seed(seed_value)
    @_fuzz_settings(examples)
    @given(case=cases())
    def run(case: Case) -> None:
        run_case(case, mode)

    run()


# ---------------------------------------------------------------------------------------------
# Client functions, written once over a namespace `xp` (jax.numpy or torch): the bridge runs the
# jnp version vmapped over the clients in one XLA program, the reference the torch version in a
# Python loop. Each uses every leaf.


def _size(x: Any) -> int:
    return math.prod(x.shape)


def _total(values: list[Any]) -> Any:
    return functools.reduce(operator.add, values)


def _summaries(xp: Any, server: Any, client: Any) -> tuple[list[Any], list[Any], Any, Any]:
    s_leaves, c_leaves = jax.tree.leaves(server), jax.tree.leaves(client)
    s_sum = _total([xp.tanh(s).sum() for s in s_leaves])
    c_mean = _total([(c * c).mean() for c in c_leaves])
    return s_leaves, c_leaves, s_sum, c_mean


def _dot(xp: Any, server: Any, client: Any) -> Any:
    """A scalar: elementwise products of (prefixes of) every server and client leaf."""
    s_leaves, c_leaves, s_sum, c_mean = _summaries(xp, server, client)
    terms = [s_sum * c_mean]
    for s in s_leaves:
        for c in c_leaves:
            k = min(_size(s), _size(c))
            terms.append((xp.tanh(s.reshape(-1)[:k]) * c.reshape(-1)[:k]).sum())
    return _total(terms)


def _tree(xp: Any, server: Any, client: Any) -> Any:
    """A pytree mirroring both inputs: each leaf scaled by a summary of the other side."""
    _, _, s_sum, c_mean = _summaries(xp, server, client)
    return {
        "client": jax.tree.map(lambda c: c * s_sum + xp.sin(c), client),
        "server": jax.tree.map(lambda s: s * c_mean - s * s, server),
    }


def _matmul(xp: Any, server: Any, client: Any) -> Any:
    """tanh(c @ s) for a 2-d server leaf s that fits a client leaf c, else of their outer
    product; returned with a scalar in a (array, [scalar]) tuple."""
    s_leaves, c_leaves, s_sum, c_mean = _summaries(xp, server, client)
    pairs = [
        (s, c)
        for s in s_leaves
        if s.ndim == 2
        for c in c_leaves
        if c.ndim >= 1 and c.shape[-1] == s.shape[0]
    ]
    if pairs:
        s, c = pairs[0]
        hidden = xp.tanh(c @ s)
    else:
        hidden = xp.tanh(xp.outer(s_leaves[0].reshape(-1), c_leaves[0].reshape(-1)))
    return (hidden * s_sum, [(hidden * hidden).sum() + c_mean])


def _passthrough(xp: Any, server: Any, client: Any) -> Any:
    """The inputs themselves, the server twice (outputs that are inputs, or each other)."""
    del xp  # Unused.
    return {"server": server, "client": client, "again": (server, client, server)}


def _jax_dot(server: Any, client: Any) -> Any:
    return _dot(jnp, server, client)


def _jax_tree(server: Any, client: Any) -> Any:
    return _tree(jnp, server, client)


def _jax_matmul(server: Any, client: Any) -> Any:
    return _matmul(jnp, server, client)


def _jax_passthrough(server: Any, client: Any) -> Any:
    return _passthrough(jnp, server, client)


BODIES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "dot": (_jax_dot, functools.partial(_dot, torch)),
    "tree": (_jax_tree, functools.partial(_tree, torch)),
    "matmul": (_jax_matmul, functools.partial(_matmul, torch)),
    "passthrough": (_jax_passthrough, functools.partial(_passthrough, torch)),
}
FUZZ_BODIES = ("dot", "tree", "matmul")


def _jax_round(server: Any, clients: Any, weights: Any, reduce: str, body: Callable) -> Any:
    """One round written with the JAX-level primitives, for `torch_function`."""
    n = jax.tree.leaves(clients)[0].shape[0]
    with jax_core.program(placements={"clients": n}):
        placed = jax_core.broadcast(server)
        results = jax_core.map_fn(body, (placed, clients))
        if reduce == "sum":
            return jax_core.reduce_sum(results)
        if reduce == "mean":
            return jax_core.reduce_mean(results)
        return jax_core.reduce_weighted_mean(results, weights)


ROUND = bridge_mr.torch_function(_jax_round)


# ---------------------------------------------------------------------------------------------
# Cases: plain data (hypothesis prints it on failure), tensors built from it by seed.

LAYOUTS = ("contiguous", "transposed", "gapped", "offset", "expanded")


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    server: Any  # A pytree of leaf indices into server_leaves.
    clients: Any  # A pytree of leaf indices into client_leaves.
    server_leaves: tuple[tuple[tuple[int, ...], bool, str], ...]  # (shape, requires_grad, layout)
    client_leaves: tuple[tuple[tuple[int, ...], bool, str], ...]  # (trailing shape, ...)
    body: str
    reduce: str
    weights: str | None  # None, "vector" ([n]) or "tree" (shaped like the output).
    weights_grad: bool
    unit_cotangent: bool
    seed: int


_DIMS = st.lists(st.integers(1, 3), max_size=3).map(tuple)
_KEYS = ("w", "b", "z9", "aa", "kernel", "B")


@st.composite
def _structure(draw: Any, leaves: tuple[int, ...], depth: int = 0) -> Any:
    """A pytree of dicts, tuples and lists holding `leaves` (in order), at most 3 deep."""
    if len(leaves) == 1 and (depth >= 2 or draw(st.booleans())):
        return leaves[0]
    if depth >= 2 or len(leaves) == 1:
        groups = [leaves] if len(leaves) == 1 else [(leaf,) for leaf in leaves]
    else:
        cuts = sorted(draw(st.sets(st.integers(1, len(leaves) - 1), max_size=len(leaves) - 1)))
        bounds = [0, *cuts, len(leaves)]
        groups = [leaves[a:b] for a, b in itertools.pairwise(bounds)]
    children = [draw(_structure(group, depth + 1)) for group in groups]
    if draw(st.integers(0, 7)) == 0:
        children.append(draw(st.sampled_from([(), [], {}])))  # An empty subtree.
    kind = draw(st.sampled_from(("dict", "tuple", "list")))
    if kind == "dict":
        keys = draw(st.permutations(_KEYS))[: len(children)]
        return dict(zip(keys, children, strict=True))
    return tuple(children) if kind == "tuple" else children


@st.composite
def cases(
    draw: Any,
    bodies: tuple[str, ...] = FUZZ_BODIES,
    layouts: tuple[str, ...] = LAYOUTS,
    reductions: tuple[str, ...] = ("mean", "sum", "weighted_mean"),
) -> Case:
    n = draw(st.integers(1, 17))
    s_shapes = draw(st.lists(_DIMS, min_size=1, max_size=4))
    c_shapes = draw(st.lists(_DIMS, min_size=1, max_size=4))
    body = draw(st.sampled_from(bodies))
    if body == "matmul" and draw(st.booleans()):
        a, b = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        s_shapes[0] = (a, b)
        c_shapes[0] = (*draw(st.lists(st.integers(1, 3), max_size=2)), a)
    layout = st.one_of(st.just("contiguous"), st.sampled_from(layouts))

    def leaves(shapes: list[tuple[int, ...]]) -> tuple[Any, ...]:
        return tuple((shape, draw(st.booleans()), draw(layout)) for shape in shapes)

    reduce = draw(st.sampled_from(reductions))
    weighted = reduce == "weighted_mean"
    return Case(
        n=n,
        server=draw(_structure(tuple(range(len(s_shapes))))),
        clients=draw(_structure(tuple(range(len(c_shapes))))),
        server_leaves=leaves(s_shapes),
        client_leaves=leaves(c_shapes),
        body=body,
        reduce=reduce,
        weights=draw(st.sampled_from(("vector", "tree"))) if weighted else None,
        weights_grad=weighted and draw(st.booleans()),
        unit_cotangent=draw(st.integers(0, 3)) == 0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return strides


def _tensor(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """A tensor of random values with the given memory layout (a leaf, not requiring grad)."""
    values = torch.randn(shape, dtype=dtype, generator=gen)
    ndim = len(shape)
    if layout == "transposed" and ndim >= 2:
        flipped = tuple(reversed(range(ndim)))
        return values.permute(flipped).contiguous().permute(flipped)
    if layout == "gapped" and ndim >= 1:
        out = torch.empty_strided(shape, [2 * s for s in _strides(shape)], dtype=dtype)
        return out.copy_(values)
    if layout == "offset":
        return torch.empty(values.numel() + 1, dtype=dtype)[1:].view(shape).copy_(values)
    if layout == "expanded" and ndim >= 1:
        return values[:1].expand(shape)
    return values


@dataclasses.dataclass
class Built:
    """A case's tensors and its pure-torch reference."""

    case: Case
    mode: Mode
    server: Any
    clients: Any
    weights: Any
    diff: list[torch.Tensor]  # The leaves that require grad: server, clients, weights.
    per_client: list[Any]  # fn's output for each client (torch, with autograd).
    expected: Any
    cotangents: list[torch.Tensor]
    expected_grads: list[torch.Tensor]

    @property
    def jax_body(self) -> Callable[..., Any]:
        return BODIES[self.case.body][0]

    def grads(self, out: Any) -> list[torch.Tensor]:
        return _grads(out, self.diff, self.cotangents)


def _grads(out: Any, diff: list[torch.Tensor], cotangents: list[torch.Tensor]) -> list[Any]:
    """Gradients of sum(out * cotangents) w.r.t. `diff` (zeros where it does not depend)."""
    if not diff:
        return []
    loss = _total([(o * ct).sum() for o, ct in zip(jax.tree.leaves(out), cotangents, strict=True)])
    if not loss.requires_grad:  # The reference's loss may not depend on any such leaf.
        return [torch.zeros_like(t) for t in diff]
    return list(torch.autograd.grad(loss, diff, allow_unused=True, materialize_grads=True))


def _reduce_reference(stacked: Any, reduce: str, weights: Any, kind: str | None) -> Any:
    if reduce == "sum":
        return jax.tree.map(lambda x: x.sum(0), stacked)
    if reduce == "mean":
        return jax.tree.map(lambda x: x.mean(0), stacked)
    if kind == "vector":
        return jax.tree.map(
            lambda x: (x * weights.reshape(-1, *[1] * (x.ndim - 1))).sum(0) / weights.sum(),
            stacked,
        )
    return jax.tree.map(lambda x, w: (x * w).sum(0) / w.sum(0), stacked, weights)


# What the built cases covered, printed by the summary.
FEATURES: collections.Counter[str] = collections.Counter()


def _has_empty_node(tree: Any) -> bool:
    if isinstance(tree, (dict, list, tuple)):
        children = list(tree.values()) if isinstance(tree, dict) else list(tree)
        return not children or any(_has_empty_node(child) for child in children)
    return False


def _note_features(case: Case, leaves: list[torch.Tensor], stacked: Any) -> None:
    FEATURES[f"reduce={case.reduce}" + (f"/{case.weights}" if case.weights else "")] += 1
    FEATURES[f"fn={case.body}"] += 1
    FEATURES["n=1" if case.n == 1 else "n=2..8" if case.n <= 8 else "n=9..17"] += 1
    FEATURES[f"{len(case.server_leaves)}+{len(case.client_leaves)} leaves"] += 1
    if _has_empty_node(case.server) or _has_empty_node(case.clients):
        FEATURES["empty subtree"] += 1
    if jax.tree.structure(case.server).num_leaves == 1 and not isinstance(case.server, int):
        FEATURES["nested single-leaf server"] += 1
    if case.body == "matmul" and any(
        len(s) == 2 and len(c) >= 1 and c[-1] == s[0]
        for s, _, _ in case.server_leaves
        for c, _, _ in case.client_leaves
    ):
        FEATURES["matmul c @ s"] += 1
    for shape, _, _ in case.server_leaves:
        FEATURES[f"server {len(shape)}-d"] += 1
    for shape, _, _ in case.client_leaves:
        FEATURES[f"client [n]+{len(shape)}-d"] += 1
    for leaf in leaves:
        if 0 in leaf.stride() and leaf.numel() > 1 and max(leaf.shape) > 1:
            FEATURES["stride-0 leaf"] += 1
        elif not leaf.is_contiguous():
            FEATURES["non-contiguous leaf"] += 1
        elif leaf.storage_offset():
            FEATURES["offset leaf"] += 1
    grads = [case.server_leaves, case.client_leaves]
    for name, specs in zip(("server", "client"), grads, strict=True):
        FEATURES[
            f"{name} grads: "
            + (
                "all"
                if all(g for _, g, _ in specs)
                else "some"
                if any(g for _, g, _ in specs)
                else "none"
            )
        ] += 1
    if case.weights_grad:
        FEATURES["weights grads"] += 1
    if case.unit_cotangent:
        FEATURES["cotangent 1"] += 1
    if len(jax.tree.leaves(stacked)) > 1:
        FEATURES["pytree output"] += 1


def build(case: Case, mode: Mode) -> Built:
    gen = torch.Generator().manual_seed(case.seed)
    dtype = mode.dtype

    def make(spec: tuple[tuple[int, ...], bool, str], lead: tuple[int, ...]) -> torch.Tensor:
        shape, requires_grad, layout = spec
        return _tensor((*lead, *shape), layout, dtype, gen).requires_grad_(requires_grad)

    s_leaves = [make(spec, ()) for spec in case.server_leaves]
    c_leaves = [make(spec, (case.n,)) for spec in case.client_leaves]
    server = jax.tree.map(lambda i: s_leaves[i], case.server)
    clients = jax.tree.map(lambda i: c_leaves[i], case.clients)
    torch_body = BODIES[case.body][1]
    per_client = [
        torch_body(server, jax.tree.map(lambda c, i=i: c[i], clients)) for i in range(case.n)
    ]
    stacked = jax.tree.map(lambda *xs: torch.stack(xs), *per_client)

    def positive(shape: tuple[int, ...]) -> torch.Tensor:
        w = torch.rand(shape, dtype=dtype, generator=gen).add_(0.1)
        return w.requires_grad_(case.weights_grad)

    weights = None
    if case.weights == "vector":
        weights = positive((case.n,))
    elif case.weights == "tree":
        weights = jax.tree.map(lambda x: positive(tuple(x.shape)), stacked)
    expected = _reduce_reference(stacked, case.reduce, weights, case.weights)
    diff = [t for t in [*s_leaves, *c_leaves, *jax.tree.leaves(weights)] if t.requires_grad]
    cotangents = [
        torch.ones_like(x)
        if case.unit_cotangent
        else torch.randn(x.shape, dtype=dtype, generator=gen)
        for x in jax.tree.leaves(expected)
    ]
    expected_grads = _grads(expected, diff, cotangents)
    _note_features(case, [*s_leaves, *c_leaves], stacked)
    return Built(
        case,
        mode,
        server,
        clients,
        weights,
        diff,
        per_client,
        jax.tree.map(torch.Tensor.detach, expected),
        cotangents,
        expected_grads,
    )


# ---------------------------------------------------------------------------------------------
# Comparison.


def compare(actual: Any, expected: Any, mode: Mode, tally: Tally, what: str) -> list[str]:
    """Problems with `actual` against `expected` (structure, shape, dtype, values)."""
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    if a_def != e_def:
        return [f"{what}: tree {a_def} != {e_def}"]
    problems = []
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        where = f"{what} leaf {i}"
        if not isinstance(a, torch.Tensor):
            problems.append(f"{where}: a {type(a).__name__}, not a torch.Tensor")
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            problems.append(f"{where}: {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}")
            continue
        a64, e64 = a.detach().double(), e.detach().double()
        err = (a64 - e64).abs()
        scale = float(e64.abs().max())
        max_abs = float(err.max())
        # Normwise, over leaves not at roundoff level: the weights' gradient with one client,
        # say, is 0 in exact arithmetic and ~eps in both, at a relative error of ~1.
        rel = max_abs / scale if scale > 100 * torch.finfo(e.dtype).eps else 0.0
        tally.leaves += 1
        tally.max_abs = max(tally.max_abs, max_abs)
        tally.max_rel = max(tally.max_rel, rel)
        tolerance = mode.rtol * (max(1.0, scale) + e64.abs())
        if not bool((err <= tolerance).all()):  # NaN fails too.
            problems.append(
                f"{where}{list(a.shape)}: max abs error {max_abs:.3g} (rel {rel:.3g}) over "
                f"tolerance rtol={mode.rtol:g}\n  got  {a64.flatten()[:6].tolist()}\n  want "
                f"{e64.flatten()[:6].tolist()}"
            )
    return problems


def _requires_grad_problems(out: Any, expected_requires_grad: bool, what: str) -> list[str]:
    got = [leaf.requires_grad for leaf in jax.tree.leaves(out)]
    if any(g != expected_requires_grad for g in got):
        return [f"{what}: requires_grad {got}, expected all {expected_requires_grad}"]
    return []


def settle(kind: str, built: Built, problems: list[str]) -> None:
    tally = _tally(kind, built.mode)
    tally.cases += 1
    if problems:
        tally.mismatches += 1
        raise AssertionError(
            f"{kind} {built.mode.name} mismatch for {built.case}:\n" + "\n".join(problems)
        )


def check_values_and_grads(
    kind: str, built: Built, out: Any, grads: list[Any], *, live: bool = True
) -> None:
    """Settles a case: `out` (the call's own results if `live`, else copies) and `grads`."""
    tally = _tally(kind, built.mode)
    problems = compare(out, built.expected, built.mode, tally, "value")
    if live:
        problems += _requires_grad_problems(out, bool(built.diff), "value")
    problems += compare(grads, built.expected_grads, built.mode, tally, "grad")
    settle(kind, built, problems)


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
    _fuzz(_run_map_reduce, MODES[mode], examples, seed_value)


def _run_primitives(case: Case, mode: Mode) -> None:
    built = build(case, mode)
    tally = _tally("primitives", mode)
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
    problems += _requires_grad_problems(out, bool(built.diff), "reduction")
    problems += compare(grads, built.expected_grads, mode, tally, "grad")
    settle("primitives", built, problems)


@pytest.mark.parametrize(
    ("mode", "examples", "seed_value"), _legs(("x64-f64", 12, 4), ("x32-f32", 6, 5))
)
def test_torch_level_primitives_equal_a_torch_loop(mode, examples, seed_value):
    _fuzz(_run_primitives, MODES[mode], examples, seed_value)


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
    _fuzz(_run_torch_function, MODES[mode], examples, seed_value)


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
    tally = _tally("aliasing", mode)
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
        want = _reduce_reference(stacked, case.reduce, built.weights, case.weights)
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
    @_fuzz_settings(examples)
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
