"""The dependency rules of bridge_mr's layers, enforced.

| layer (`bridge_mr.`) | may import from bridge_mr | importing it loads |
|---|---|---|
| `_flags` | nothing | neither jax nor torch |
| `_caches` (the cache registry) | nothing | neither jax nor torch |
| `typing` (the shared types) | nothing | neither jax nor torch |
| `_compat` | nothing (each submodule: its own library only) | `_compat.jax`: jax, no torch |
| `jax_core` | `_compat`, `typing` | jax (never torch, torch_xla) |
| top level | `jax_core`, `_flags`, `typing`; the subpackages lazily | jax |
| `_dtypes` | `_compat` | jax, torch |
| `dlpack` | `_compat`, `_dtypes` | jax, torch |
| `runners` | `dlpack`, `jax_core`, `distributed`, `_compat`, `_dtypes` | jax, torch (+ torch_xla) |
| `auto` | `jax_core`, `dlpack`, `distributed`, `_compat`, `_dtypes` | jax, torch |
| `torch_api` | `auto`, `runners` and what they may import | jax, torch |
| `torch_fn` (`from_torch`) | `_compat` | jax, torch (torchax on first call) |
| `distributed` | nothing | jax (no torch) |
| `beam` | `jax_core`, `_compat` | jax (apache_beam on building a pipeline; `_worker`: jax only) |
| `algorithms` | public names of `torch_api`, `jax_core` and `typing` only | jax, torch (optax) |
| `data` | public names of `algorithms`, `torch_api`, `jax_core`, `dlpack`, `typing` | jax, torch |
| `demo` | any public name | jax, torch |
| `benchmarks/`, `examples/` | public names only, never the demo | |

Every layer but `_flags`, `_compat`, `_dtypes`, `algorithms`, `data` and `demo` may also import
`_caches`, where its module-level caches register; and the layers that annotate with the shared
types import `typing` (standard library only). No module of bridge_mr is longer than
`MAX_LINES` (500) lines.

And, over every module of bridge_mr (module-level, `TYPE_CHECKING` and function-local imports
alike):

* No module imports a private name (`_x`) or a private module of another subpackage, nor reads
  one as an attribute (`jax_core._mesh`). The shared private modules `bridge_mr._compat`,
  `bridge_mr._dtypes` and `bridge_mr._flags` are the exception: the layers above may import
  them (their public names).
* No import cycles: no two modules import each other, directly or through others.
* Nothing imports `bridge_mr.demo` but the demo itself (and its tests): it is a leaf.

And no test outside tests/benchmarks/ imports the benchmarks (`benchmarks.*`, or their loader
`helpers.bench`).

"Loads when imported" is checked in a fresh interpreter per layer. A subpackage (but the demo)
is imported under a stand-in for the `bridge_mr` package (its real directory, without running
`bridge_mr/__init__.py`), so what the top level imports does not count against it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.child import run_python

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "bridge_mr"

# The heavy libraries whose import the table restricts (jaxlib counts as jax).
FRAMEWORKS = ("jax", "torch", "torch_xla", "apache_beam", "torchax")
# Private, imported by the layers above.
SHARED = frozenset({"_caches", "_compat", "_dtypes", "_flags"})
#: No module of bridge_mr is longer: a longer one has more than one job (split it at its seams).
MAX_LINES = 500
DEMO = "demo"


@dataclasses.dataclass(frozen=True)
class Layer:
    may_import: frozenset[str]  # bridge_mr subpackages (and what they may, when imported)
    lazily: frozenset[str] = frozenset()  # statically only: loaded on first use
    public_only: bool = False  # may import any public name (the demo)


LAYERS: dict[str, Layer] = {
    "_flags": Layer(frozenset()),
    "_caches": Layer(frozenset()),
    "_compat": Layer(frozenset()),
    "typing": Layer(frozenset()),
    "jax_core": Layer(frozenset({"_compat", "_caches", "typing"})),
    "": Layer(
        frozenset({"jax_core", "_flags", "_caches", "typing"}),
        lazily=frozenset(
            {"dlpack", "torch_api", "torch_fn", "distributed", "algorithms", "auto", "data", "beam"}
        ),
    ),
    "_dtypes": Layer(frozenset({"_compat"})),
    "dlpack": Layer(frozenset({"_compat", "_dtypes", "_caches"})),
    "runners": Layer(
        frozenset({"dlpack", "jax_core", "distributed", "_compat", "_dtypes", "_caches"})
    ),
    "auto": Layer(
        frozenset({"jax_core", "dlpack", "distributed", "_compat", "_dtypes", "_caches", "typing"})
    ),
    "torch_api": Layer(
        frozenset(
            {"jax_core", "dlpack", "runners", "distributed", "auto", "_compat", "_dtypes"}
            | {"_caches", "typing"}
        )
    ),
    "torch_fn": Layer(frozenset({"_compat", "_caches"})),
    "distributed": Layer(frozenset({"_caches"})),
    "beam": Layer(frozenset({"jax_core", "_compat", "_caches"})),
    "algorithms": Layer(frozenset({"jax_core", "torch_api", "typing"}), public_only=True),
    "data": Layer(
        frozenset({"jax_core", "torch_api", "algorithms", "dlpack", "typing"}), public_only=True
    ),
    DEMO: Layer(frozenset(), public_only=True),
}

# Module to import in a fresh interpreter -> the frameworks that import may load.
LOADS: dict[str, frozenset[str]] = {
    "bridge_mr._flags": frozenset(),
    "bridge_mr._caches": frozenset(),
    "bridge_mr.typing": frozenset(),
    "bridge_mr._compat.jax": frozenset({"jax"}),
    "bridge_mr.jax_core": frozenset({"jax"}),
    "bridge_mr": frozenset({"jax"}),
    "bridge_mr._dtypes": frozenset({"jax", "torch"}),
    "bridge_mr.dlpack": frozenset({"jax", "torch"}),
    "bridge_mr.runners": frozenset({"jax", "torch"}),
    "bridge_mr.auto": frozenset({"jax", "torch"}),
    "bridge_mr.torch_api": frozenset({"jax", "torch"}),
    "bridge_mr.torch_fn": frozenset({"jax", "torch"}),
    "bridge_mr.distributed": frozenset({"jax"}),
    "bridge_mr.beam": frozenset({"jax"}),  # apache_beam when a pipeline is built
    "bridge_mr.algorithms": frozenset({"jax", "torch"}),
    "bridge_mr.data": frozenset({"jax", "torch"}),
    "bridge_mr.demo": frozenset({"jax", "torch"}),
}


def _loadable(layer: str) -> set[str]:
    """The layers importing `layer` may load: its own imports and theirs, transitively."""
    found: set[str] = set()
    todo = [layer]
    while todo:
        for other in LAYERS[todo.pop()].may_import - found:
            found.add(other)
            todo.append(other)
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _layer_of(module: str) -> str:
    """The subpackage (or shared module) a bridge_mr module belongs to; "" for the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# ---------------------------------------------------------------------------------------------
# Static: every import statement of the source tree.


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. bridge_mr.torch_api._function
    path: str  # file, relative to the repository
    line: int
    target: str  # the absolute module imported (from)
    name: str | None  # the name imported from `target`, if not a module itself


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level else []
    return ".".join([*base, *([module] if module else [])])


def _imports(path: Path) -> Iterator[Import]:
    """Every import in the file, anywhere (module level, TYPE_CHECKING, functions)."""
    importer = _module_name(path)
    is_package = path.name == "__init__.py"
    where = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(), filename=where)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, where, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(importer, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield Import(importer, where, node.lineno, submodule, None)
                else:
                    yield Import(importer, where, node.lineno, target, alias.name)


def _private_attributes(path: Path) -> Iterator[Import]:
    """`alias._x` where `alias` is bound to a bridge_mr module by an import in the file."""
    importer = _module_name(path)
    is_package = path.name == "__init__.py"
    where = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), filename=where)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(importer, is_package, node.level, node.module)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and aliases.get(node.value.id, "").split(".")[0] == PACKAGE
            and _is_private(node.attr)
        ):
            yield Import(importer, where, node.lineno, aliases[node.value.id], node.attr)


def _ours(imports: Iterator[Import]) -> list[Import]:
    return [imp for imp in imports if imp.target.split(".")[0] == PACKAGE]


BRIDGE_MR = {_module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py"))}
MODULES = frozenset(BRIDGE_MR)
OURS = [imp for path in BRIDGE_MR.values() for imp in _ours(_imports(path))]  # Every module's.


def _privacy_problem(imp: Import, *, public_only: bool) -> str | None:
    """Why `imp` reaches a private name it may not, or None. `public_only`: no exceptions."""
    own = None if public_only else _layer_of(imp.importer)
    layer = _layer_of(imp.target)
    if layer == own:
        return None
    inner = imp.target.split(".")[2:]  # Modules inside the subpackage.
    private = [part for part in inner if _is_private(part)]
    if _is_private(layer) and (public_only or layer not in SHARED):
        private.insert(0, layer)
    if imp.name is not None and _is_private(imp.name):
        private.append(imp.name)
    if not private:
        return None
    what = imp.target + (f".{imp.name}" if imp.name else "")
    return f"{imp.path}:{imp.line}: {imp.importer} reaches {what} (private: {', '.join(private)})"


def test_no_module_reaches_a_private_name_of_another_subpackage() -> None:
    reached = [
        *OURS,
        *(read for path in BRIDGE_MR.values() for read in _private_attributes(path)),
    ]
    problems = [p for imp in reached if (p := _privacy_problem(imp, public_only=False))]
    # A public-only layer (the demo, algorithms) may not use the shared private modules either.
    problems += [
        p
        for imp in reached
        if _layer_of(imp.importer) in LAYERS
        and LAYERS[_layer_of(imp.importer)].public_only
        and _layer_of(imp.target) != _layer_of(imp.importer)
        and (p := _privacy_problem(imp, public_only=True))
    ]
    assert not problems, "\n".join(dict.fromkeys(problems))


def test_each_layer_imports_only_what_the_table_allows() -> None:
    problems = []
    for imp in OURS:
        own, other = _layer_of(imp.importer), _layer_of(imp.target)
        if other == own or own not in LAYERS:  # The next test reports a layer not in the table.
            continue
        layer = LAYERS[own]
        if other == DEMO and own != DEMO:
            problems.append(f"{imp.path}:{imp.line}: {imp.importer} imports the demo (a leaf)")
        # A public-only layer with subpackages listed (algorithms) is held to them; the
        # demo's empty list means any.
        elif (not layer.public_only or layer.may_import) and other not in (
            layer.may_import | layer.lazily
        ):
            allowed = ", ".join(sorted(layer.may_import | layer.lazily)) or "no subpackage"
            problems.append(
                f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target} "
                f"({other or 'the top level'}); {own or 'the top level'} may import {allowed}"
            )
    assert not problems, "\n".join(problems)


def test_the_table_covers_every_subpackage() -> None:
    layers = {_layer_of(module) for module in MODULES}
    assert layers <= set(LAYERS), f"layers missing from the table: {layers - set(LAYERS)}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_modules() -> None:
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for imp in OURS:
        if imp.target in MODULES:
            edges.setdefault(imp.importer, set()).add(imp.target)
            where.setdefault((imp.importer, imp.target), f"{imp.path}:{imp.line}")
    problems = []
    for cycle in _cycles(edges):
        members = set(cycle)
        lines = [
            f"  {a} -> {b} ({where[(a, b)]})"
            for a in cycle
            for b in sorted(edges.get(a, set()) & members)
        ]
        problems.append("cycle:\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("folder", ["benchmarks", "examples"])
def test_benchmarks_and_examples_use_public_names_only(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    problems = []
    for path in files:
        for imp in [*_ours(_imports(path)), *_private_attributes(path)]:
            if _layer_of(imp.target) == DEMO:
                problems.append(f"{imp.path}:{imp.line}: imports the demo ({imp.target})")
            elif problem := _privacy_problem(imp, public_only=True):
                problems.append(problem)
    assert not problems, "\n".join(dict.fromkeys(problems))  # One line per import statement.


#: The loader of the benchmarks for their tests (tests/helpers/bench.py).
BENCH_LOADER = "helpers.bench"


def _benchmark_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, name) of each way the file reaches the benchmarks: an import of `benchmarks`, an
    `import_module` / `__import__` of it by name, or the loader `helpers.bench`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else None
            called = node.func.id if isinstance(node.func, ast.Name) else called
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] == "benchmarks" or f"{name}.".startswith(f"{BENCH_LOADER}."):
                yield node.lineno, name


def test_no_test_outside_tests_benchmarks_imports_the_benchmarks() -> None:
    """The library's tests stand without the benchmarks (which may import the tests' helpers,
    `helpers.zoo`, never the other way round); only tests/benchmarks/ loads them."""
    tests = ROOT / "tests"
    own = tests / "benchmarks"
    found = {path: list(_benchmark_imports(path)) for path in sorted(tests.rglob("*.py"))}
    assert any(found[path] for path in found if own in path.parents), "the check finds nothing"
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path, hits in found.items()
        if own not in path.parents and path != tests / "helpers" / "bench.py"
        for line, name in hits
    ]
    assert not problems, "tests outside tests/benchmarks/ import the benchmarks:\n" + "\n".join(
        problems
    )


# ---------------------------------------------------------------------------------------------
# Dynamic: what importing each layer loads, in a fresh interpreter.

_CHILD = textwrap.dedent(
    """
    import importlib, json, sys, types

    target, package_dir, mode = sys.argv[1:]
    if mode == "stand-in":
        # A stand-in for the package: its submodules import, its __init__ does not run.
        stub = types.ModuleType("bridge_mr")
        stub.__path__ = [package_dir]
        sys.modules["bridge_mr"] = stub
    importlib.import_module(target)
    print(json.dumps(sorted(sys.modules)))
    """
)


def _package_dir() -> str:
    """The bridge_mr that tests import (the installed one), without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None
    assert spec.submodule_search_locations
    return spec.submodule_search_locations[0]


@pytest.mark.parametrize("target", sorted(LOADS))
def test_importing_a_layer_loads_only_what_the_table_allows(target: str) -> None:
    own = _layer_of(target)
    layer = LAYERS[own]
    # The top level, and the demo (which may use it), import bridge_mr itself.
    mode = "real" if own == "" or layer.public_only else "stand-in"
    child = run_python(["-c", _CHILD, target, _package_dir(), mode], timeout=300)
    loaded = json.loads(child.splitlines()[-1])
    frameworks = {"jax" if m == "jaxlib" else m for m in loaded if "." not in m} & set(FRAMEWORKS)
    layers = {_layer_of(m) for m in loaded if m.split(".")[0] == PACKAGE and m != PACKAGE}
    extra_frameworks = frameworks - LOADS[target]
    extra_layers = set() if layer.public_only else layers - _loadable(own) - {own}
    assert not extra_frameworks, f"import {target} loaded {sorted(extra_frameworks)}"
    assert not extra_layers, f"import {target} loaded bridge_mr.{sorted(extra_layers)}"


def test_no_module_is_longer_than_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / PACKAGE).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split each at its seams): {long}"
