"""The benchmarks, the examples and the demo use bridge_mr's public names only, and nothing
imports the demo: a change inside bridge_mr's private modules or inside the demo cannot
silently change what a benchmark measures or break an example.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The modules a user imports: the package and its public subpackages (`bridge_mr.auto`: its
#: `__all__`, e.g. the cost model `cost` the accelerator rows count FLOPs with).
PUBLIC_MODULES = {
    "bridge_mr",
    "bridge_mr.auto",
    "bridge_mr.data",
    "bridge_mr.dlpack",
    "bridge_mr.jax_core",
}


def _sources(root: Path, folder: str) -> Iterator[tuple[str, ast.AST]]:
    for path in sorted((root / folder).rglob("*.py")):
        yield str(path.relative_to(root)), ast.parse(path.read_text(), str(path))


def _names(tree: ast.AST) -> Iterator[tuple[int, str, int]]:
    """(line, dotted name, relative level) of every module or name imported, and every
    attribute read from a plain name (`bridge_mr.x`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            yield node.lineno, module, node.level
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}".lstrip("."), node.level
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            yield node.lineno, f"{node.value.id}.{node.attr}", 0


def _private_use(name: str) -> str | None:
    """Why an absolute `name` is not a public bridge_mr name (None if it is, or not bridge_mr)."""
    parts = name.split(".")
    if parts[0] != "bridge_mr":
        return None
    if "demo" in parts:
        return "the demo"
    if any(part.startswith("_") for part in parts):
        return "a private name"
    if name not in PUBLIC_MODULES and ".".join(parts[:-1]) not in PUBLIC_MODULES:
        return "a non-public module"
    return None


@pytest.mark.parametrize("folder", ["benchmarks", "examples", "bridge_mr/demo"])
def test_only_public_bridge_mr_names(pytestconfig: pytest.Config, folder: str) -> None:
    found = [
        f"{path}:{line}: {name} ({why})"
        for path, tree in _sources(pytestconfig.rootpath, folder)
        for line, name, level in _names(tree)
        if level == 0 and (why := _private_use(name)) is not None
    ]
    assert not found, "\n".join(found)


def test_nothing_in_the_library_imports_the_demo(pytestconfig: pytest.Config) -> None:
    found = [
        f"{path}:{line}: {name}"
        for path, tree in _sources(pytestconfig.rootpath, "bridge_mr")
        if not path.startswith("bridge_mr/demo/")
        for line, name, level in _names(tree)
        if "demo" in name.split(".") and (level > 0 or name.startswith("bridge_mr."))
    ]
    assert not found, "\n".join(found)
