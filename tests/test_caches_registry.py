"""Every module-level cache of bridge_mr is registered, and `clear_caches()` empties them all.

A module-level container (dict, list, set, weak dictionary or set) is a cache unless it is named
below with why it is not: a constant table, a memo of one import made once, the process state
`initialize` connected, the registry itself.
"""

from __future__ import annotations

import collections
import importlib
import pkgutil
import weakref
from types import ModuleType

import pytest

import bridge_mr
from bridge_mr import _caches

CONTAINERS = (
    dict,
    list,
    set,
    collections.OrderedDict,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
)

NOT_CACHES = {
    "bridge_mr._caches._CLEARS": "the registry itself",
    "bridge_mr._caches._OBJECTS": "the registry itself",
    "bridge_mr._dtypes.DTYPES": "a constant table",
    "bridge_mr._dtypes._BY_JAX": "a constant table",
    "bridge_mr.distributed._initialize._STARTED": "the process initialize() connected",
    "bridge_mr.dlpack._export.ACTIVE": "the open conversion-statistics blocks (a stack)",
    "bridge_mr.dlpack._import.ACTIVE": "the open conversion-statistics blocks (a stack)",
    "bridge_mr.dlpack._stats.ACTIVE": "the open conversion-statistics blocks (a stack)",
    "bridge_mr.dlpack._import._FLAGS": "a constant table",
    "bridge_mr.dlpack._owed._HANDLES": "the handles of live imports, weakly: the exit waits "
    "for XLA to release them (clearing would hide owed releases from it)",
    "bridge_mr.dlpack._runtime._cache_generation": "the backends the device cache was filled "
    "from, compared by identity",
    "bridge_mr.runners._torch_tpu.COMPILER_OPTIONS": "a constant table",
    "bridge_mr.torch_fn._environment._ENVIRONMENT": "the torchax environment, built once",
    "bridge_mr.torch_fn._recurrent._GATES": "a constant table",
    "bridge_mr.torch_fn._aliases._INSTALLED": "the view-write wrapper installed on the one "
    "torchax environment (built once, like it)",
    "bridge_mr.torch_api._keys._PRECISIONS": "a constant table",
    "bridge_mr.torch_api._function._ALL": "the live torch functions, whose entries each clear "
    "(registered through register_clear as 'torch function traces')",
    "bridge_mr.torch_api._custom_op._functions": "uid -> compilable torch function, weakly: "
    "compiled graphs find their function by uid",
    "bridge_mr.beam._rules._CLIENT_RULES": "the per-primitive rules, registered at import",
    "bridge_mr.beam._reductions._REDUCTION_RULES": "the per-primitive rules, registered at import",
}


def _modules() -> list[ModuleType]:
    """Every bridge_mr module but the demo's (which keeps no cache)."""
    names = [m.name for m in pkgutil.walk_packages(bridge_mr.__path__, "bridge_mr.")]
    return [importlib.import_module(n) for n in names if not n.startswith("bridge_mr.demo")]


def _module_level_containers() -> dict[str, object]:
    found = {}
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, CONTAINERS) and not name.startswith("__"):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_module_level_cache_is_registered() -> None:
    containers = _module_level_containers()  # Imports every module: each registers its caches.
    registered = {id(v) for v in _caches.registered().values()}
    missing = [
        name
        for name, value in containers.items()
        if name not in NOT_CACHES and id(value) not in registered
    ]
    assert not missing, (
        f"module-level caches that bridge_mr.clear_caches() cannot reach: {missing}. Register "
        f'each (`_X = bridge_mr._caches.register("what it holds", {{}})`), or name it in '
        f"NOT_CACHES with why it is not a cache."
    )


def test_not_caches_names_only_what_exists() -> None:
    _modules()
    missing = [
        name
        for name in NOT_CACHES
        if not hasattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
    ]
    assert not missing, f"NOT_CACHES names what no module has: {missing}"


def test_clear_caches_empties_every_registered_container() -> None:
    _modules()
    containers = {
        name: cache for name, cache in _caches.registered().items() if isinstance(cache, CONTAINERS)
    }
    assert containers, "no container registered"
    bridge_mr.clear_caches()
    full = {name: len(c) for name, c in containers.items() if len(c)}  # type: ignore[arg-type]
    assert not full, f"still full after clear_caches(): {full}"


def test_a_name_is_registered_once() -> None:
    _caches.register("test: twice", {})
    with pytest.raises(ValueError, match=r"a cache named 'test: twice' is registered already"):
        _caches.register("test: twice", {})
