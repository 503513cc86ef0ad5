"""The beam caches (plans, self-tested plans, worker segments) are bounded or weak, and
registered: `bridge_mr._caches.clear_all()` (what `bridge_mr.clear_caches()` walks) empties them.
"""

from __future__ import annotations

import numpy as np
import pytest

import bridge_mr.beam as bb
from bridge_mr import _caches
from bridge_mr import jax_core as mr
from bridge_mr._caches import Bounded
from bridge_mr.beam import _planning, _worker

# jax.export serializes the segments with flatbuffers (part of the `beam` extra).
pytest.importorskip("flatbuffers")

F32 = np.float32


def scaled_mean(server, x):
    """One round: server_0, client_0 and server_1, three segments."""
    return server + mr.reduce_mean(mr.map_fn(lambda s, v: v * s, (mr.broadcast(server), x)))


def records(count, size=3):
    return [(np.full(size, i, F32),) for i in range(count)]


def test_a_bounded_cache_used_as_an_lru_keeps_the_most_recently_used_entries():
    dropped = []
    cache = Bounded[str, int](2, on_drop=dropped.append)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.use("a") == 1  # Now "b" is the least recently used.
    cache.put("c", 3)
    assert len(cache) == 2
    assert dropped == ["b"]
    assert (cache.use("a"), cache.use("b"), cache.use("c")) == (1, None, 3)
    cache.put("a", 4)  # An existing key: replaced, nothing dropped.
    assert dropped == ["b"]
    assert cache.get("a") == 4
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="expected at least 1; got 0"):
        Bounded[str, int](0)


def test_a_program_keeps_at_most_plans_per_function_plans(monkeypatch):
    monkeypatch.setattr(_planning, "PLANS_PER_FUNCTION", 2)

    def program(server, x):  # A new function: its plans are counted from none.
        return scaled_mean(server, x)

    plans = [bb.split(program, (F32(1),), (np.zeros(size, F32),)) for size in (1, 2, 3)]
    assert len(_planning._PLANS[program]) == 2
    assert bb.split(program, (F32(1),), (np.zeros(3, F32),)) is plans[2]  # Still cached.
    assert bb.split(program, (F32(1),), (np.zeros(1, F32),)) is not plans[0]  # Dropped.


def test_a_worker_keeps_at_most_its_bound_of_segments(monkeypatch):
    monkeypatch.setattr(_worker, "_CACHE", Bounded[bytes, object](2))
    plan = bb.split(scaled_mean, (F32(2),), records(1)[0])
    assert len(plan.segments) == 3
    for _ in range(2):
        result = bb.interpret(plan, (F32(2),), records(4), bundle_sizes=[1, 3])
        np.testing.assert_allclose(result, np.full(3, 2 + 2 * 1.5, F32))
        assert len(_worker._CACHE) == 2


def test_the_beam_caches_are_registered_and_clear_all_empties_them():
    registered = _caches.registered()
    assert registered["beam plans"] is _planning._PLANS
    assert registered["beam self-tested plans"] is _planning._CHECKED
    assert registered["beam worker segments"] is _worker._CACHE
    plan, _, _ = _planning.prepare(
        scaled_mean, (F32(2),), records(1)[0], placement="clients", check=True
    )  # Splits, self-tests (which runs the segments), and remembers both.
    assert scaled_mean in _planning._PLANS
    assert _planning._CHECKED[id(plan)] is plan
    assert len(_worker._CACHE) > 0
    _caches.clear_all()
    assert len(_planning._PLANS) == 0
    assert len(_planning._CHECKED) == 0
    assert len(_worker._CACHE) == 0
