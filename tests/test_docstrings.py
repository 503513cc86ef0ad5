"""The public names' docstrings: one Google style, and their `>>>` examples run as doctests.

Every public callable and class of the public modules (each module's `__all__`), and every
public method of those classes defined in bridge_mr (not the hooks of an outside framework
that it overrides), has a one-line summary, the `Args:`,
`Returns:` (or `Yields:`) and `Raises:` sections its signature and body call for, and an
`Example:` section of `>>>` lines (never an rst `Example::` block). The examples run with
`doctest` (ELLIPSIS | NORMALIZE_WHITESPACE) under the test session's configuration (x64 off,
strict dtype promotion, warnings as errors), in a namespace of small fixtures (`torch`, `jax`,
`jnp`, `np`, `optax`, `bridge_mr`, `alg`, `params`, `batch`, `batches`, `client_loss`,
`jax_loss`, `local`, `scaled_mean`; see `_namespace`), so each example can stay short.

`test_docstring[...]` is one case per public name, whichever bridge_mr package defines it (every
package follows the style).
"""

from __future__ import annotations

import ast
import doctest
import functools
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

#: The modules whose `__all__` lists the public names, in the order names are first reported.
MODULES = (
    "bridge_mr",
    "bridge_mr.algorithms",
    "bridge_mr.data",
    "bridge_mr.distributed",
    "bridge_mr.torch_fn",
    "bridge_mr.dlpack",
    "bridge_mr.jax_core",
    "bridge_mr.beam",
    "bridge_mr.auto",
)


#: Google style's section titles (a line of prose ending in a colon is not one).
_TITLES = ("Args", "Attributes", "Returns", "Yields", "Raises", "Example", "Examples", "Note")
_SECTION = re.compile(rf"^\s*({'|'.join(_TITLES)}):\s*$", re.M)
_RST_EXAMPLE = re.compile(r"^\s*Examples?::\s*$", re.M)


def _in_bridge_mr(module: str) -> bool:
    """Whether `module` is bridge_mr or one of its submodules (a name's module: where defined)."""
    return module == "bridge_mr" or module.startswith("bridge_mr.")


def _defining_module(obj: Any) -> str:
    return getattr(inspect.unwrap(obj), "__module__", None) or ""


def _methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    """The public methods of `cls` defined in bridge_mr (its own and its bridge_mr bases').

    Not those that override a method of a base defined outside bridge_mr: framework hooks
    (apache_beam's `CombineFn.add_input`, `PTransform.expand`, ...) that the framework
    documents; bridge_mr gives them a one-line docstring only.
    """
    outside = {
        attr for base in cls.__mro__ if not _in_bridge_mr(base.__module__) for attr in vars(base)
    }
    found: dict[str, Callable[..., Any]] = {}
    for base in cls.__mro__:
        if not _in_bridge_mr(base.__module__):
            continue
        for attr, value in vars(base).items():
            if attr.startswith("_") or attr in found or attr in outside:
                continue
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            if inspect.isfunction(inspect.unwrap(value)):
                found[attr] = value
    return sorted(found.items())


def _collect() -> tuple[dict[str, Any], dict[str, str]]:
    """(public, broken): public name -> object, each under its first public name.

    broken: module name -> why it could not be imported (its names are not collected; the
    module's own test case fails with the reason).
    """
    public_names: dict[str, Any] = {}
    broken: dict[str, str] = {}
    seen: set[int] = set()

    def add(name: str, obj: Any) -> None:
        if not _in_bridge_mr(_defining_module(obj)) or id(obj) in seen:
            return
        seen.add(id(obj))
        public_names[name] = obj

    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
            public = {name: getattr(module, name) for name in module.__all__}  # loads lazy names
        except (ImportError, AttributeError, SyntaxError) as error:  # test_public_modules_import
            broken[module_name] = f"{type(error).__name__}: {error}"
            continue
        for name, obj in public.items():
            if isinstance(obj, ModuleType) or not (inspect.isclass(obj) or callable(obj)):
                continue  # submodules (collected on their own), constants, JAX primitives
            add(f"{module_name}.{name}", obj)
            if inspect.isclass(obj) and _in_bridge_mr(obj.__module__):
                for attr, method in _methods(obj):
                    add(f"{module_name}.{name}.{attr}", method)
    return public_names, broken


_PUBLIC, _BROKEN = _collect()


# The fixtures the examples use. Built per example (examples may set `.grad` or step an
# optimizer); the functions are made once, so later examples reuse their compiled programs.


def _client_loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One client's mean squared error of a linear model, in torch."""
    return torch.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _scaled_mean(w: Any, x: Any) -> Any:
    """A MapReduce program for bridge_mr.beam: the mean over clients of `w * x` (w: server)."""
    from bridge_mr import jax_core as mr

    return mr.reduce_mean(mr.map_fn(jnp.multiply, (mr.broadcast(w), x)))


@functools.cache
def _converted_functions() -> dict[str, Any]:
    import optax

    import bridge_mr
    from bridge_mr import algorithms as alg

    jax_loss = bridge_mr.from_torch(_client_loss)
    return {"jax_loss": jax_loss, "local": alg.local_training(jax_loss, optax.sgd(0.1), steps=2)}


def _namespace() -> dict[str, Any]:
    """The globals every example starts from.

    params: `{"w": [3] zeros, "b": [] zero}` (torch, requiring grad), a linear model.
    batch: one batch per client, 8 clients: `{"x": [8, 4, 3], "y": [8, 4] ones}`.
    batches: a stack of 2 batches per client (for `local`): `{"x": [8, 2, 4, 3], "y": ...}`.
    client_loss: `(params, batch) -> mean squared error`, in torch; jax_loss: its
    `bridge_mr.from_torch` conversion; local: `alg.local_training(jax_loss, optax.sgd(0.1),
    steps=2)`. With zero params and targets 1, every client's loss is 1.0.
    scaled_mean: `(w, x) -> reduce_mean(map_fn(jnp.multiply, (broadcast(w), x)))`, a
    MapReduce program of one round for bridge_mr.beam (w: a server scalar; x: one per client).
    """
    import optax

    import bridge_mr
    from bridge_mr import algorithms as alg

    generator = torch.Generator().manual_seed(0)
    return {
        "__name__": "bridge_mr_docstring_example",
        "torch": torch,
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "optax": optax,
        "bridge_mr": bridge_mr,
        "alg": alg,
        "params": {
            "w": torch.zeros(3, requires_grad=True),
            "b": torch.zeros((), requires_grad=True),
        },
        "batch": {"x": torch.randn(8, 4, 3, generator=generator), "y": torch.ones(8, 4)},
        "batches": {"x": torch.randn(8, 2, 4, 3, generator=generator), "y": torch.ones(8, 2, 4)},
        "client_loss": _client_loss,
        "scaled_mean": _scaled_mean,
        **_converted_functions(),
    }


# The style.


def _sections(doc: str) -> dict[str, str]:
    """Section title -> its text, for the Google-style sections of a cleaned docstring."""
    matches = list(_SECTION.finditer(doc))
    return {
        m.group(1): doc[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(doc)]
        for i, m in enumerate(matches)
    }


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError):
        return None


def _parameters(obj: Any) -> list[str]:
    """The parameter names the docstring must describe (not self, *args or **kwargs)."""
    signature = _signature(obj)
    if signature is None:
        return []
    names = [
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _function_node(obj: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of `obj`'s own body (a class: its __init__), None without source."""
    target = inspect.unwrap(obj.__init__ if inspect.isclass(obj) else obj)
    if inspect.isclass(obj) and "__init__" not in vars(obj):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


def _raises(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the function's own body (not a nested function's) has a raise statement."""
    pending: list[ast.AST] = list(node.body)
    while pending:
        child = pending.pop()
        if isinstance(child, ast.Raise):
            return True
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(ast.iter_child_nodes(child))
    return False


def _returns_value(obj: Any) -> bool:
    """Whether the function's annotation says it returns something (a class: never)."""
    if inspect.isclass(obj):
        return False
    signature = _signature(obj)
    if signature is None:
        return False
    annotation = signature.return_annotation
    return annotation not in (inspect.Signature.empty, None, "None", "NoReturn")


def _style_problems(name: str, obj: Any) -> list[str]:
    raw = obj.__doc__  # Not inspect.getdoc: a class without one would show its base's.
    if not raw:
        return [f"{name} has no docstring"]
    doc = inspect.cleandoc(raw)
    lines = doc.splitlines()
    problems = []
    if len(lines) > 1 and lines[1].strip():
        problems.append("the summary is not one line (the second line is not blank)")
    if not lines[0].rstrip().endswith("."):
        problems.append(f"the summary line does not end with a period: {lines[0]!r}")
    if _RST_EXAMPLE.search(doc):
        problems.append("has an rst `Example::` block; use an `Example:` section of >>> lines")
    sections = _sections(doc)
    example = sections.get("Example", sections.get("Examples"))
    if example is None:
        problems.append("has no `Example:` section")
    elif ">>>" not in example:
        problems.append("its `Example:` section has no >>> lines")
    titles = list(sections)
    if example is not None and titles[-1] not in ("Example", "Examples"):
        problems.append(f"the `Example:` section is not the last one (sections: {titles})")
    described = sections.get("Args", "") + sections.get("Attributes", "")
    parameters = _parameters(obj)
    if parameters and not described:
        problems.append(f"has no `Args:` section for its parameters {parameters}")
    else:
        missing = [p for p in parameters if not re.search(rf"\b{re.escape(p)}\b", described)]
        if missing:
            problems.append(f"its `Args:` section does not describe {missing}")
    if _returns_value(obj) and "Returns" not in sections and "Yields" not in sections:
        problems.append("returns a value but has no `Returns:` (or `Yields:`) section")
    node = _function_node(obj)
    if node is not None and _raises(node) and "Raises" not in sections:
        problems.append("raises but has no `Raises:` section")
    return problems


# The examples.


def _run_examples(name: str, obj: Any) -> tuple[int, str]:
    """Runs the docstring's examples; returns (how many ran, the report of those that failed)."""
    finder = doctest.DocTestFinder(recurse=False)
    target = inspect.unwrap(obj) if not inspect.isclass(obj) else obj
    report: list[str] = []
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    attempted = 0
    for test in finder.find(target, name, globs=_namespace()):
        result = runner.run(test, out=report.append, clear_globs=True)
        attempted += result.attempted
    return attempted, "".join(report)


def _check(name: str, obj: Any) -> None:
    problems = _style_problems(name, obj)
    attempted, failures = _run_examples(name, obj)
    if failures:
        problems.append(f"its examples fail:\n{failures}")
    elif attempted == 0 and not any("Example" in p or "docstring" in p for p in problems):
        problems.append("its examples did not run")
    assert not problems, f"{name}'s docstring:\n- " + "\n- ".join(problems)


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_docstring(name: str) -> None:
    _check(name, _PUBLIC[name])


@pytest.mark.parametrize("module", MODULES)
def test_public_modules_import(module: str) -> None:
    assert module not in _BROKEN, f"{module} (and so its docstrings): {_BROKEN[module]}"


def test_the_public_names_are_collected() -> None:
    names = set(_PUBLIC)
    for expected in (
        "bridge_mr.broadcast",
        "bridge_mr.clear_caches",
        "bridge_mr.from_torch",  # a lazy name of bridge_mr
        "bridge_mr.map_reduce",
        "bridge_mr.algorithms.ClientSampler.sample",  # a public method
        "bridge_mr.distributed.initialize",
        "bridge_mr.torch_fn.UnsupportedTorchOperation",
        "bridge_mr.dlpack.to_jax",
        "bridge_mr.jax_core.map_fn",
        "bridge_mr.beam.split",
    ):
        assert expected in names, sorted(names)
    assert "bridge_mr.torch_fn.from_torch" not in names  # collected once, as bridge_mr.from_torch
