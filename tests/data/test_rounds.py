"""bridge_mr.data's rounds: cohorts, the [clients, steps, batch] gather, padding, determinism."""

from __future__ import annotations

import pytest
import torch

from bridge_mr import algorithms as alg
from bridge_mr import data as fd

COUNTS = [3, 7, 12, 5, 1, 9]


def _dataset() -> fd.FederatedDataset:
    """Unequal clients; example e of client c has x = 100 c + e (so each slot names its source)."""
    clients = {
        c: {"x": 100.0 * c + torch.arange(float(n)), "y": torch.full((n,), c)}
        for c, n in enumerate(COUNTS)
    }
    return fd.FederatedDataset.from_clients(clients)


def _real(rnd: fd.Round, row: int) -> torch.Tensor:
    """Row `row`'s real x values, in slot order."""
    return rnd.batches["x"][row][rnd.batches["mask"][row] > 0]


def test_epochs_fill_each_client_in_order_then_pad() -> None:
    train = _dataset()
    g = torch.Generator().manual_seed(0)
    rnd = train.round(batch_size=4, epochs=2, generator=g)
    steps = -(-2 * max(COUNTS) // 4)  # ceil(24 / 4)
    assert rnd.batches["x"].shape == (6, steps, 4)
    assert rnd.batches["y"].shape == rnd.batches["mask"].shape == (6, steps, 4)
    for c, n in enumerate(COUNTS):
        mask = rnd.batches["mask"][c].flatten()
        assert mask.tolist() == [1.0] * (2 * n) + [0.0] * (4 * steps - 2 * n)  # real slots first
        real = _real(rnd, c)
        own = 100.0 * c + torch.arange(float(n))
        # Two passes, one after the other, each a permutation of the client's examples.
        assert torch.equal(real[:n].sort().values, own)
        assert torch.equal(real[n:].sort().values, own)
        assert (rnd.batches["y"][c] == c).all()  # padding slots repeat the client's own example
    assert rnd.weights.tolist() == [float(n) for n in COUNTS]
    assert rnd.client_mask.tolist() == [1.0] * 6


def test_steps_take_a_random_subset_or_pad() -> None:
    train = _dataset()
    rnd = train.round(batch_size=2, steps=3, generator=torch.Generator().manual_seed(1))
    assert rnd.batches["x"].shape == (6, 3, 2)
    for c, n in enumerate(COUNTS):
        real = _real(rnd, c)
        assert len(real) == min(n, 6)
        assert len(real.unique()) == len(real)  # without replacement
        assert ((real >= 100 * c) & (real < 100 * c + n)).all()


def test_steps_and_epochs_together_cut_the_passes_to_the_steps() -> None:
    train = _dataset()
    g = torch.Generator().manual_seed(4)
    rnd = train.round(batch_size=4, steps=3, epochs=2, generator=g)
    assert rnd.batches["x"].shape == (6, 3, 4)
    for c, n in enumerate(COUNTS):
        real = _real(rnd, c)
        assert len(real) == min(2 * n, 12)  # two passes, cut to 3 steps of 4
        first_pass = real[: min(n, 12)]
        assert len(first_pass.unique()) == len(first_pass)  # the first pass: no repeats
        assert ((first_pass >= 100 * c) & (first_pass < 100 * c + n)).all()
        if n <= 12:  # the whole first pass fits: it is a permutation of the client's examples
            assert torch.equal(first_pass.sort().values, 100.0 * c + torch.arange(float(n)))
    # Enough passes for every client: no padding slot at all, which padding=False then allows.
    full = train.round(batch_size=4, steps=2, epochs=8, padding=False, generator=g)
    assert bool(full.batches["mask"].all())
    with pytest.raises(ValueError, match=r"3 pass\(es\) over client 4's 1 examples give only 3"):
        train.round(batch_size=4, steps=2, epochs=3, padding=False, generator=g)


def test_poisson_cohort_rows_and_padding_rows() -> None:
    train = _dataset()
    cohort = alg.Cohort(torch.tensor([1, 4]), padded_size=4)
    rnd = train.round(cohort, batch_size=4, steps=2, generator=torch.Generator().manual_seed(2))
    assert rnd.batches["x"].shape == (4, 2, 4)
    assert torch.equal(rnd.weights, cohort.weights(train.example_counts))
    assert rnd.weights.tolist() == [7.0, 1.0, 0.0, 0.0]
    assert rnd.client_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert rnd.batches["mask"][2:].sum() == 0  # padding rows: no real example
    assert rnd.batches["mask"][1].sum() == 1
    assert ((_real(rnd, 0) >= 100) & (_real(rnd, 0) < 107)).all()
    empty = alg.Cohort(torch.tensor([], dtype=torch.int64), padded_size=1)  # Poisson drew none
    rnd = train.round(empty, batch_size=4, steps=2, generator=torch.Generator().manual_seed(2))
    assert rnd.batches["x"].shape == (1, 2, 4)
    assert rnd.batches["mask"].sum() == 0


def test_rounds_are_deterministic_by_seed_and_advance() -> None:
    train = _dataset()

    def two_rounds(seed: int) -> list[torch.Tensor]:
        sampler = train.sampler(cohort_size=3, generator=seed)
        g = torch.Generator().manual_seed(seed)
        return [
            train.round(sampler.sample(), batch_size=3, epochs=1, generator=g).batches["x"]
            for _ in range(2)
        ]

    first, second = two_rounds(5)
    again = two_rounds(5)
    assert torch.equal(first, again[0])
    assert torch.equal(second, again[1])
    assert not torch.equal(first, second)  # the generators advanced
    assert not torch.equal(first, two_rounds(6)[0])


def test_uniform_cohorts_sample_without_replacement_evenly() -> None:
    clients, size, draws = 10, 3, 3000
    sampler = fd.FederatedDataset.from_tensors(
        {"x": torch.arange(20.0)}, torch.arange(20) % clients
    ).sampler(cohort_size=size, generator=0)
    hits = torch.zeros(clients)
    for _ in range(draws):
        cohort = sampler.sample()
        assert cohort.size == cohort.padded_size == size
        assert len(cohort.indices.unique()) == size
        hits[cohort.indices] += 1
    frequency = hits / draws  # each client: size / clients = 0.3, sd about 0.008
    assert float((frequency - size / clients).abs().max()) < 0.035


def test_poisson_cohorts_have_clientsamplers_distribution() -> None:
    clients, q, draws = 40, 0.25, 2000
    train = fd.FederatedDataset.from_tensors({"x": torch.arange(80.0)}, torch.arange(80) % clients)
    sampler = train.sampler(probability=q, generator=1)
    reference = alg.ClientSampler(clients, probability=q, generator=1)
    assert sampler.expected_cohort_size == reference.expected_cohort_size == clients * q
    sizes, hits = [], torch.zeros(clients)
    for _ in range(draws):
        cohort, same = sampler.sample(), reference.sample()
        assert torch.equal(cohort.indices, same.indices)
        assert cohort.padded_size == same.padded_size
        sizes.append(cohort.size)
        hits[cohort.indices] += 1
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    assert abs(float(sizes_t.mean()) - clients * q) < 0.25  # sd of the mean: 0.06
    assert abs(float(sizes_t.var()) - clients * q * (1 - q)) < 1.0  # binomial variance 7.5
    assert float((hits / draws - q).abs().max()) < 0.05


def test_on_the_datasets_device_with_one_gather() -> None:
    train = _dataset().to("meta")  # any device: nothing but the gather runs there
    rnd = train.round(batch_size=4, steps=1, generator=torch.Generator().manual_seed(0))
    assert rnd.batches["x"].device.type == "meta"
    assert rnd.batches["mask"].device.type == "meta"
    assert rnd.weights.device.type == "meta"


def test_bad_round_arguments_are_named() -> None:
    train = _dataset()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(
        ValueError,
        match=r"steps=2 x batch_size=4 = 8 .* 1 pass\(es\) over client 0's 3 examples give only "
        r"3 \(4 client\(s\) fall short\)\. Fix: padding=True",
    ):
        train.round(batch_size=4, steps=2, padding=False, generator=g)
    with pytest.raises(ValueError, match=r"padding=False\): 1 epoch\(s\) of client 0's 3 "):
        train.round(batch_size=4, epochs=1, padding=False, generator=g)
    with pytest.raises(ValueError, match=r"expected steps= .*epochs= .* or both .*got neither"):
        train.round(batch_size=4, generator=g)
    with pytest.raises(ValueError, match=r"round\(batch_size=...\): expected an int >= 1, got 0"):
        train.round(batch_size=0, steps=1, generator=g)
    with pytest.raises(TypeError, match=r"expected a torch.Generator, created once"):
        train.round(batch_size=1, steps=1, generator=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"client indices in \[0, 6\), got \[2, 9\]"):
        train.round(alg.Cohort(torch.tensor([2, 9]), 2), batch_size=1, steps=1, generator=g)
    # Equal clients that fill their slots exactly need no padding.
    equal = fd.FederatedDataset.from_tensors({"x": torch.arange(12.0)}, torch.arange(12) % 3)
    rnd = equal.round(batch_size=2, epochs=1, padding=False, generator=g)
    assert rnd.batches["mask"].shape == (3, 2, 2)
    assert bool(rnd.batches["mask"].all())
