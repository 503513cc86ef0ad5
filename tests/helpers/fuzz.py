"""The differential fuzz harness of tests/torch_api/test_fuzz.py (whose docstring says what is
fuzzed and how it is judged).

Modes (`MODES`: dtype, x64, rtol) and the module-level `TALLY` the summary test prints; client
functions written once over a namespace `xp` (jax.numpy or torch); `cases()`, the hypothesis
strategy of plain-data `Case`s; `build(case, mode)`, the tensors and the torch-loop reference
(values and gradients) of a case as a `Built`; `compare` / `settle` / `check_values_and_grads`,
which judge a result against it; `fuzz(run_case, mode, examples, seed)`, which runs `run_case`
on `examples` cases, reproducibly.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
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


def tally_of(kind: str, mode: Mode) -> Tally:
    return TALLY.setdefault((kind, mode.name), Tally())


def fuzz_settings(max_examples: int) -> Callable[[Any], Any]:
    # A fixed seed per test (and no example database): every run tries the same cases.
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=False)


def fuzz(
    run_case: Callable[[Case, Mode], None], mode: Mode, examples: int, seed_value: int
) -> None:
    """Runs `run_case` on `examples` generated cases, reproducibly from `seed_value`."""

    @seed(seed_value)
    @fuzz_settings(examples)
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


def reduce_reference(stacked: Any, reduce: str, weights: Any, kind: str | None) -> Any:
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
    expected = reduce_reference(stacked, case.reduce, weights, case.weights)
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


def requires_grad_problems(out: Any, expected_requires_grad: bool, what: str) -> list[str]:
    got = [leaf.requires_grad for leaf in jax.tree.leaves(out)]
    if any(g != expected_requires_grad for g in got):
        return [f"{what}: requires_grad {got}, expected all {expected_requires_grad}"]
    return []


def settle(kind: str, built: Built, problems: list[str]) -> None:
    tally = tally_of(kind, built.mode)
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
    tally = tally_of(kind, built.mode)
    problems = compare(out, built.expected, built.mode, tally, "value")
    if live:
        problems += requires_grad_problems(out, bool(built.diff), "value")
    problems += compare(grads, built.expected_grads, built.mode, tally, "grad")
    settle(kind, built, problems)
