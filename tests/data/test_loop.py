"""bridge_mr.data.rounds: the loop over a training's rounds, its seeds, cycling, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge_mr import algorithms as alg
from bridge_mr import data as fd

COUNTS = [3, 7, 12, 5, 1, 9]


def _dataset() -> fd.FederatedDataset:
    """Unequal clients; example e of client c has x = 100 c + e (so each slot names its source)."""
    clients = {c: {"x": 100.0 * c + torch.arange(float(n))} for c, n in enumerate(COUNTS)}
    return fd.FederatedDataset.from_clients(clients)


def test_rounds_are_the_loop_over_round_with_a_cohort_each() -> None:
    train = _dataset()
    got = list(
        fd.rounds(
            train,
            4,
            sampler=train.sampler(probability=0.5, generator=1),
            batch_size=3,
            steps=2,
            generator=torch.Generator().manual_seed(2),
        )
    )
    sampler = train.sampler(probability=0.5, generator=1)
    g = torch.Generator().manual_seed(2)
    expected = [train.round(sampler.sample(), batch_size=3, steps=2, generator=g) for _ in range(4)]
    assert len(got) == 4
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.cohort.indices, b.cohort.indices)
        assert a.cohort.padded_size == b.cohort.padded_size
        assert a.batches.keys() == b.batches.keys() == {"x", "mask"}
        for name in a.batches:
            assert torch.equal(a.batches[name], b.batches[name])
        assert torch.equal(a.weights, b.weights)
        assert torch.equal(a.client_mask, b.client_mask)
    assert len({tuple(a.cohort.indices.tolist()) for a in got}) > 1  # a cohort each round
    assert list(fd.rounds(train, 0, batch_size=1, steps=1, generator=0)) == []


def test_an_int_seed_starts_afresh_and_a_generator_advances() -> None:
    train = _dataset()

    def xs(generator: torch.Generator | int, num_rounds: int = 2) -> list[torch.Tensor]:
        loop = fd.rounds(train, num_rounds, batch_size=2, epochs=1, generator=generator)
        return [rnd.batches["x"] for rnd in loop]

    once, again = xs(7), xs(7)  # every client, every round: only the order differs
    assert all(torch.equal(a, b) for a, b in zip(once, again, strict=True))
    assert not torch.equal(once[0], once[1])
    g = torch.Generator().manual_seed(7)
    first, later = xs(g), xs(g)  # one generator across two calls: it goes on
    assert all(torch.equal(a, b) for a, b in zip(first + later, xs(7, 4), strict=True))


def test_cycle_fills_every_clients_steps_with_whole_passes_and_no_padding() -> None:
    train = _dataset()
    loop = fd.rounds(
        train, 2, batch_size=4, steps=3, cycle=True, padding=False, generator=0
    )  # 12 slots: 12 passes of the 1-example client, one of the 12-example client
    for rnd in loop:
        assert rnd.batches["x"].shape == (6, 3, 4)
        assert bool(rnd.batches["mask"].all())
        for c, n in enumerate(COUNTS):
            slots = rnd.batches["x"][c].flatten()
            own = 100.0 * c + torch.arange(float(n))
            for start in range(0, 12 - n + 1, n):  # each whole pass: a permutation
                assert torch.equal(slots[start : start + n].sort().values, own)
            assert ((slots >= 100 * c) & (slots < 100 * c + n)).all()


def test_a_uniform_cohort_of_a_dataset_sampler() -> None:
    train = _dataset()
    sampler = train.sampler(cohort_size=2, generator=0)
    for rnd in fd.rounds(train, 3, sampler=sampler, batch_size=2, steps=1, generator=0):
        assert rnd.batches["x"].shape == (2, 1, 2)
        assert rnd.weights.tolist() == [float(COUNTS[c]) for c in rnd.cohort.indices]
        assert rnd.client_mask.tolist() == [1.0, 1.0]


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"num_rounds": -1}, ValueError, r"rounds\(num_rounds=...\): expected an int >= 0, got -1"),
    ({"batch_size": 0}, ValueError, r"rounds\(batch_size=...\): expected an int >= 1, got 0"),
    ({"steps": True}, ValueError, r"rounds\(steps=...\): expected an int >= 1, got True"),
    ({"steps": None, "epochs": 0}, ValueError, r"rounds\(epochs=...\): expected an int >= 1"),
    (
        {"steps": None, "epochs": 2, "cycle": True},
        ValueError,
        r"cycle=True\): .*expected steps= and no epochs=, got steps=None, epochs=2\. Fix",
    ),
    ({"epochs": 2, "cycle": True}, ValueError, r"got steps=1, epochs=2\. Fix: steps= alone"),
    ({"cycle": 1}, TypeError, r"rounds\(cycle=...\): expected a bool, got 1"),
    ({"sampler": object()}, TypeError, r"expected a bridge_mr.algorithms.ClientSampler"),
    (
        {"sampler": alg.ClientSampler(5, cohort_size=2, generator=0)},
        ValueError,
        r"a sampler of the dataset's 6 clients, got one of 5\. Fix: dataset.sampler",
    ),
    ({"generator": 1.5}, TypeError, r"rounds\(generator=...\): .* int seed, got float"),
    ({"steps": None}, ValueError, r"expected steps= .*epochs= .* or both .*got neither"),
    (
        {"steps": 2, "padding": False},
        ValueError,
        r"padding=False\): steps=2 x batch_size=2 .* client 0's 3 examples give only 3",
    ),
]


def _change_id(change: dict[str, Any]) -> str:
    # Objects by type, not by repr: an id with a memory address differs between processes.
    plain = (int, float, str, type(None))
    return ",".join(
        f"{k}={v if isinstance(v, plain) else type(v).__name__}" for k, v in change.items()
    )


@pytest.mark.parametrize(
    ("change", "error", "message"), BAD, ids=[_change_id(c) for c, _, _ in BAD]
)
def test_bad_arguments_are_named_when_called_before_any_round(
    change: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments: dict[str, Any] = {"num_rounds": 3, "batch_size": 2, "steps": 1, "generator": 0}
    with pytest.raises(error, match=message):
        fd.rounds(_dataset(), **{**arguments, **change})  # not iterated: refused at the call
    with pytest.raises(TypeError, match=r"expected a bridge_mr.data.FederatedDataset, got dict"):
        fd.rounds({"x": torch.ones(3)}, **arguments)  # pyright: ignore[reportArgumentType]
